"""Plain dataclasses exchanged between drafter, verifier, sampler and engine (and, pickled, between Ray deployments)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Temperatures below this decode greedily: there the tempered softmax under/overflows (NaN in float32), as in vLLM.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen; applied to the target p and the draft q alike so speculation stays exact."""

    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(frozen=True)
class DraftRequest:
    """Ask the drafter for up to `k` tokens continuing `tokens` (the committed sequence, prompt included)."""

    seq_id: str
    tokens: list[int]
    k: int  # draft depth (the spine of a tree)
    params: SamplingParams = SamplingParams()
    tree: bool = False  # propose a token tree: deterministic top-1 spine of depth k plus siblings
    width: int = 1  # tree only: candidates per depth, the draft's top-`width` tokens (spine + width - 1 siblings)
    min_score: float = 0.0  # tree only: stop deepening once the spine's path probability falls below this
    # Tree only: nodes expanded per depth (EAGLE-2 frontier, one batched draft forward per depth); 1: the top-1 spine.
    frontier: int = 1
    # One exit threshold per draft exit for this row (a target's calibration profile); None: the drafter's own.
    # Per row, so targets whose profiles differ only in thresholds share one draft forward.
    thresholds: tuple[float, ...] | None = None
    # Tree only: whose earlier outputs this row may draft from (core/suffix.py; "" is the shared scope).
    suffix_scope: str = ""


@dataclass
class Proposal:
    """Draft tokens for one sequence: a chain (parents None) or a token tree (see core/tree.py).

    `q` is None for deterministic candidates (greedy drafting, tree nodes, lookup): a point mass on each token.
    """

    tokens: list[int]  # [k']  k' <= k (confidence stop may end early); tree nodes in topological order
    q: torch.Tensor | None  # [k', V] draft probabilities the tokens were sampled from (chains only)
    exits: list[int]  # [k'] exit layer each token left the draft at (0: a lookup candidate)
    parents: list[int] | None = None  # tree: parent node index of each node, -1 = the last committed token
    scores: list[float] | None = None  # tree: draft probability of the path to each node (ranking for budgets)
    match_ngram: int = 0  # tree: suffix length the first lookup candidate matched (0: none; the budget values it)

    @staticmethod
    def empty() -> "Proposal":
        return Proposal(tokens=[], q=None, exits=[])

    @property
    def is_tree(self) -> bool:
        return self.parents is not None


@dataclass(frozen=True)
class PromptScoring:
    """Reduce a request's first `rows` logit rows to logprobs where the logits are (ScoreRequest.prompt).

    Row j of those scores the token after it in the request's tokens; the answer keeps that token's logprob and the
    `top_n` most likely (id, logprob) pairs (core/logprobs.py rules for `params`), so a prompt of P tokens costs
    O(P x top_n) numbers to ship instead of O(P x vocabulary)."""

    rows: int
    top_n: int = 0
    params: SamplingParams = SamplingParams()


@dataclass
class ScoredPrompt:
    """A verifier's answer to a request with `prompt` set: the leading rows reduced, the rest as logits."""

    chosen: torch.Tensor  # [rows] the logprob of each row's next token
    top_ids: torch.Tensor  # [rows, top_n] long, most likely first
    top_logprobs: torch.Tensor  # [rows, top_n]
    logits: torch.Tensor  # [num_logits - rows, V] the round's own rows, as a request without `prompt` gets them


@dataclass(frozen=True)
class ScoreRequest:
    """Ask the verifier for target logits at the last `num_logits` positions of `tokens` (committed + draft)."""

    seq_id: str
    tokens: list[int]
    num_logits: int
    # A token tree: the last len(parents) tokens are tree nodes (parent index, -1 = the token before them), verified
    # with tree attention (each node sees the prefix and its ancestors); num_logits must be len(parents) + 1.
    parents: list[int] | None = None
    # The caller needs only each row's argmax (a greedy row asking no logprobs): a remote verifier may answer with the
    # ids [num_logits] instead of [num_logits, V] logits (49152 floats a row for SmolLM2: megabytes per tree round).
    argmax_only: bool = False
    # Plain greedy steps to take in this one call (a row with no draft, argmax_only, one logit): the verifier appends
    # its own argmax and scores again, up to `steps` tokens or a token in `stop_ids`, and answers the ids it chose.
    # A served round pays a deployment call per target call, so a plain row gets several tokens per call
    # (`core/steps.py`).
    steps: int = 1
    stop_ids: tuple[int, ...] = ()
    # The LoRA adapter this row is verified under ("" the base model): a verifier with a LoraBank (core/lora.py)
    # applies each row's own adapter in the one batched forward.
    adapter: str = ""
    # Score the leading rows as prompt logprobs on the verifier (its answer is then a ScoredPrompt): only the prompt's
    # top-n travel back, not its P x vocabulary logits. Chains only, and never the last row (it has no next token).
    prompt: PromptScoring | None = None


@dataclass
class RoundResult:
    """What one verification round did for one sequence."""

    n_drafted: int  # draft tokens (chain) or tree nodes verified
    n_accepted: int  # accepted draft tokens (the accepted path's length), bonus excluded
    new_tokens: list[int]  # accepted draft tokens + the target's own next token (before stop truncation)
    exits: list[int]  # per drafted token/node, the accepted path's first (0: lookup)


@dataclass
class SequenceMetrics:
    """Per-request counters in vLLM's naming, plus S2D's exit histogram and timing."""

    num_spec_steps: int = 0  # rounds that verified at least one draft token
    num_target_forwards: int = 0  # every verification forward, plain steps included
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_generated_tokens: int = 0
    acceptance_histogram: dict[int, int] = field(default_factory=dict)  # n_accepted -> rounds
    exit_histogram: dict[int, int] = field(default_factory=dict)  # exit layer -> draft tokens proposed there
    accepted_exit_histogram: dict[int, int] = field(default_factory=dict)  # exit layer (0: lookup) -> accepted
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # depth - 1 -> accepted tokens (vLLM)
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    total_seconds: float = 0.0
    first_token_seconds: float | None = None

    def record(self, result: RoundResult, n_emitted: int) -> None:
        self.num_target_forwards += 1
        self.num_generated_tokens += n_emitted
        if result.n_drafted == 0:
            return
        self.num_spec_steps += 1
        self.num_draft_tokens += result.n_drafted
        self.num_accepted_draft_tokens += result.n_accepted
        h = self.acceptance_histogram
        h[result.n_accepted] = h.get(result.n_accepted, 0) + 1
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (result.n_accepted - len(per_pos)))
        for i in range(result.n_accepted):
            per_pos[i] += 1
        for i, layer in enumerate(result.exits):
            layer = max(layer, 0)  # lookup's branches (tree.LOOKUP_BRANCH) count as lookup (0)
            self.exit_histogram[layer] = self.exit_histogram.get(layer, 0) + 1
            if i < result.n_accepted:
                self.accepted_exit_histogram[layer] = self.accepted_exit_histogram.get(layer, 0) + 1

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per target forward, bonus included (MAT; plain decoding = 1.0)."""
        return self.num_generated_tokens / self.num_target_forwards if self.num_target_forwards else 0.0

    def to_dict(self) -> dict:
        other = max(self.total_seconds - self.draft_seconds - self.target_seconds, 0.0)
        return {
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "num_spec_steps": self.num_spec_steps,
            "num_target_forwards": self.num_target_forwards,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "acceptance_histogram": {str(k): v for k, v in sorted(self.acceptance_histogram.items())},
            "exit_histogram": {str(k): v for k, v in sorted(self.exit_histogram.items())},
            "accepted_exit_histogram": {str(k): v for k, v in sorted(self.accepted_exit_histogram.items())},
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "tokens_per_second": self.num_generated_tokens / self.total_seconds if self.total_seconds else 0.0,
            "draft_seconds": self.draft_seconds,
            "target_seconds": self.target_seconds,
            "other_seconds": other,
            "total_seconds": self.total_seconds,
            "time_to_first_token_seconds": self.first_token_seconds,
        }
