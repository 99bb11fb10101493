"""The one speculative decoding loop, shared by the CLI, the benchmarks and the Ray router.

A round, for every unfinished sequence at once:
  1. plan: pick k per sequence (policy, capped by max_new_tokens and the context limit);
  2. propose: the drafter drafts up to k tokens (with q when sampling);
  3. verify: the verifier scores committed + draft tokens in one batched target forward (k + 1 logits each);
  4. accept: the sampler keeps a prefix and draws one target token (recovered or bonus);
  5. commit: append, apply stops, update the policy. KV rollback happens on the next sync (common-prefix cut);
  6. report: the round's measured cost and yield go to the load-aware budget, which sizes the next round.
The drafter and verifier are injected (in-process objects, or deployment clients behind the same calls), and plain
decoding is the same loop with no drafter. The round is written once (`SpecEngine._round`) and run by a synchronous
driver (`step`) or an asynchronous one (`step_async`, whose calls may answer awaitables). The request, result and
per-sequence types are in core/requests.py, step 6's report in core/round_report.py, and the stop-string search in
core/stop_strings.py.

Logits processors (a request's penalties, biases, bans or grammar; core/processors.py): between propose and verify
the engine drops the deterministic candidates they ban (`prune`), a row with processors asks the verifier for full
logits (its own argmax or plain steps would skip them), and in commit every target row is processed with its own
history (committed + the draft tokens or tree ancestors before it) before acceptance. Greedy output then equals plain
decoding with the same processors and sampling follows the processed distribution; logprobs come from the processed
rows (the distribution tokens were chosen from). A request without processors takes none of these paths.
"""

from __future__ import annotations

import time
from typing import Callable, Collection

import torch

from .budget import SpeculationBudget
from .calls import Calls, drive, drive_async
from .draft import Drafter
from .logprobs import TokenLogprob, emitted_rows, prompt_logprobs, scored_prompt_logprobs, token_logprobs
from .mixed import round_prompt_positions
from .policy import DraftLengthPolicy, HeuristicK
from .processors import process_rows, prune_banned
from .profile import RoundProfile
# The request and result types are the engine's interface: importers take them from here.
from .requests import GenerationRequest, GenerationResult, SequenceState, StepOutput
from .round_report import report_round, round_facts
from .sampling import Sampler, rejection_sample, round_generator
from .steps import stepped_scores
from .stop_strings import StopScan
from .suffix import SuffixStore
from .target import Verifier
from .tree import accept_tree, proposal_tree
from .types import DraftRequest, PromptScoring, Proposal, RoundResult, ScoredPrompt, ScoreRequest

__all__ = ["GenerationRequest", "GenerationResult", "SpecEngine", "StepOutput"]


class SpecEngine:
    """Runs rounds over many sequences; finished sequences release their KV on drafter and verifier."""

    def __init__(
        self,
        verifier: Verifier,
        drafter: Drafter | None = None,
        policy: DraftLengthPolicy | None = None,
        sampler: Sampler = rejection_sample,
        max_context: int | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        budget: SpeculationBudget | None = None,
        plain_steps: int = 1,
        suffix: SuffixStore | None = None,
        prompt_tokens: int = 0,
        detokenize_whole: bool = False,
    ) -> None:
        self.verifier, self.drafter = verifier, drafter
        # Earlier outputs as candidates (the drafter reads the same store); finished outputs are added here.
        self.suffix = suffix
        # Greedy steps per verifier call in a round where no row has draft tokens (ScoreRequest.steps): the router
        # asks for several (each call costs a deployment round trip); one step per call gives the same tokens.
        self.plain_steps = plain_steps
        # Prompt positions a round carries beside running streams (0: every prompt fills whole in the round it
        # joins): a long prompt then fills over several rounds, its chunks in the decode rows' forward
        # (core/mixed.py), and running streams keep their pace. With a cost model the budget prices the chunk.
        self.prompt_tokens = prompt_tokens
        self.policy = policy or HeuristicK()
        # Trees (width > 1 or lookup candidates) and/or cost-based, load-aware sizing; None: chains of the policy's k.
        self.budget = budget
        self.trees = budget is not None
        self.sampler = sampler
        self.max_context = max_context
        self.detokenize = detokenize
        # Stop strings are searched in each round's new text (core/stop_strings.py); True: in whole decodes, for a
        # decoder that rewrites text across token edges (clean_up_tokenization_spaces).
        self.detokenize_whole = detokenize_whole
        self.seqs: dict[str, SequenceState] = {}
        self.profile = RoundProfile()  # where rounds spend their time (draft, verify, prompt, host), for stats
        # The target's logit width (pruning probes rows of it): the verifier's when it says (an in-process target),
        # else learnt from its first full rows (a deployment client), so nothing is pruned before them.
        self.vocab: int | None = getattr(verifier, "vocab_size", None)

    # --- lifecycle ---------------------------------------------------------------------------------------------
    def add_request(self, req: GenerationRequest) -> None:
        if req.seq_id in self.seqs:
            raise ValueError(f"duplicate seq_id {req.seq_id!r}")
        if not req.prompt_ids:
            raise ValueError("prompt is empty")
        if req.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.max_context is not None and len(req.prompt_ids) >= self.max_context:
            raise ValueError(f"prompt has {len(req.prompt_ids)} tokens; the context limit is {self.max_context}")
        stops = StopScan(req.stop_strings, self.detokenize, req.min_tokens, self.detokenize_whole) \
            if req.stop_strings and self.detokenize is not None else None
        self.seqs[req.seq_id] = SequenceState(req, k=self.policy.initial() if self.drafter else 0, stops=stops)

    def abort(self, seq_id: str) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self._release(seq_id)
            if self.budget is not None:
                self.budget.release(seq_id)

    def _release(self, seq_id: str) -> None:
        """Free a finished or aborted sequence's KV on drafter and verifier."""
        self.verifier.release(seq_id)
        if self.drafter is not None:
            self.drafter.release(seq_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def live_ids(self) -> list[str]:
        """The ids of the sequences a round runs over, in admission order."""
        return list(self.seqs)

    @property
    def _sized(self) -> bool:
        """Whether the budget sizes rounds from measured costs (and learns from every round)."""
        return self.budget is not None and self.budget.load_aware

    # --- drivers -----------------------------------------------------------------------------------------------
    def step(self, only: Collection[str] | None = None) -> list[StepOutput]:
        """One round over the live sequences (`only`: just those ids), its calls answered in place."""
        return drive(self._round(only))

    async def step_async(self, only: Collection[str] | None = None) -> list[StepOutput]:
        """The same round where propose and score may answer awaitables (deployment clients); used by the router."""
        return await drive_async(self._round(only))

    # --- one round, written once for both drivers ---------------------------------------------------------------
    def _round(self, only: Collection[str] | None) -> Calls[list[StepOutput]]:
        """Steps 1-6 over the live sequences (`only`: just those ids; the others are left as they are). Yields each
        drafter and verifier call's answer and is sent back its value (core/calls.py)."""
        live = self._live(only)
        if not live:
            return []
        start = time.perf_counter()
        chunks = self.prompt_chunks(live)
        live = [seq for seq in live if seq.req.seq_id not in chunks]
        lengths = [len(seq.tokens) for seq in live]  # as planned (commit appends)
        drafts = self.plan(live)
        t0 = time.perf_counter()
        drafted = yield from self._propose(drafts)
        t_drafted = time.perf_counter()
        proposals = self.shape_trees(live, self.prune(live, drafted))
        t1 = time.perf_counter()
        requests = self.score_requests(drafts, proposals)
        logits = yield from stepped_scores(self.verifier.score, requests + [c for c in chunks.values() if c])
        logits = logits[: len(requests)]  # a chunk's one row is not used: its sequence emits when its prompt is full
        t2 = time.perf_counter()
        outputs = []
        if live:
            facts = round_facts(live, requests, proposals, (t0, t1, t2), bool(chunks)) if self._sized else {}
            outputs = self.commit(live, proposals, logits, (t1 - t0, t2 - t1))
            if self._sized:
                report_round(self.budget, live, lengths, drafted, outputs,
                             dict(facts, seconds=time.perf_counter() - t0), self.seqs)
        kind = "speculative" if any(p.tokens for p in proposals) else "plain"
        # the verification carried prompt positions: a chunk, or a row that had generated nothing when planned
        prompt = bool(chunks) or any(n == len(seq.req.prompt_ids) for seq, n in zip(live, lengths))
        asked = self.drafter is not None and any(d.k > 0 or d.tree for d in drafts)  # else no drafter call: host work
        self.profile.add(kind, sum(len(o.new_tokens) for o in outputs), time.perf_counter() - start,
                         t_drafted - t0 if asked else 0.0, t2 - t1, prompt)
        return outputs

    def _live(self, only: Collection[str] | None) -> list[SequenceState]:
        if only is None:
            return list(self.seqs.values())
        if isinstance(only, str):
            raise TypeError("only: a collection of sequence ids, not one id")
        wanted = set(only)
        return [seq for seq in self.seqs.values() if seq.req.seq_id in wanted]

    def prompt_chunks(self, live: list[SequenceState]) -> dict[str, ScoreRequest | None]:
        """Step 0: the rows that fill only part of their prompt this round (seq id -> the verifier request of its
        chunk, KV only; None: the row waits for a later round). Only while some row decodes (a round of prompts alone fills them whole, the fastest first
        token) and `prompt_tokens` is set; the round's prompt positions go first come first served and are priced by
        the budget's cost model when it has one (`SpeculationBudget.prompt_positions`). A row that wants prompt
        logprobs fills whole: its first round scores every prompt position."""
        decoding = [seq for seq in live if seq.generated]
        waiting = [seq for seq in live if not seq.generated and not seq.req.prompt_logprobs]
        if not self.prompt_tokens or not decoding or not waiting:
            return {}
        allowance = self.prompt_tokens
        if self._sized:
            allowance = self.budget.prompt_positions(len(decoding), allowance)
        pending = [len(seq.req.prompt_ids) - seq.prefilled for seq in waiting]
        chunks = {}
        for seq, n, take in zip(waiting, pending, round_prompt_positions(pending, allowance)):
            if take >= n:
                continue  # the rest of its prompt fits: the row runs this round whole and emits its first token
            seq.prefilled += take
            if take > 0:
                tokens = seq.req.prompt_ids[: seq.prefilled]
                chunks[seq.req.seq_id] = ScoreRequest(seq.req.seq_id, tokens, 1, argmax_only=True)
            else:
                chunks[seq.req.seq_id] = None
        return chunks

    def plan(self, live: list[SequenceState]) -> list[DraftRequest]:
        """Step 1: the draft request of every live sequence (k = 0 means a plain target step)."""
        plan = None
        if self._sized and self.drafter is not None:
            # Per row that may draft: what the draft must catch up on first, and what drafting can still gain it.
            rows = [(self.budget.behind(seq.req.seq_id, len(seq.tokens)), self._remaining(seq))
                    if seq.generated and seq.req.speculate and self._remaining(seq) > 0 else None for seq in live]
            plan = self.budget.plan(len(live), 0, prompts=sum(not seq.generated for seq in live), rows=rows)
        width = self.budget.shape.width if self.trees else 1
        frontier = self.budget.shape.frontier if self.trees else 1
        min_score = plan.min_score if plan is not None else 0.0
        # A round in which the draft does not run and lookup candidates do not pay (or there are none) is plain
        # decoding at plain's cost: nothing is proposed, no tree is shaped, the verifier takes its plain steps.
        candidates = plan is None or plan.depth > 0 or self._lookup_pays(len(live))
        drafts = []
        for i, seq in enumerate(live):
            k = seq.k if plan is None else 0 if i in plan.hold else plan.depth
            k = max(0, min(k, self._remaining(seq))) if self.drafter is not None and seq.req.speculate else 0
            if not seq.generated:
                # The round that fills a prompt does not draft for it (lookup candidates only, no draft forward): its
                # first token streams after the target's prefill alone, as with plain decoding; the draft fills the
                # prompt in the row's next drafting round.
                k = 0
            drafts.append(DraftRequest(seq.req.seq_id, seq.tokens, k, seq.req.params,
                                       tree=self.trees and seq.req.speculate and candidates, width=width,
                                       min_score=min_score, frontier=frontier, suffix_scope=seq.req.suffix_scope,
                                       thresholds=seq.req.draft_thresholds))
        return drafts

    def _lookup_pays(self, batch: int) -> bool:
        """Whether a round without the draft still gathers candidates (prompt lookup, earlier outputs)."""
        has_source = self.budget.shape.lookup or self.suffix is not None
        return has_source and self.budget.lookup_pays(batch)

    def _remaining(self, seq: SequenceState) -> int:
        """Draft tokens this sequence can still use (max_new_tokens and the context limit, after the bonus)."""
        if self._wants_prompt_rows(seq):
            return 0  # the round that scores the whole prompt drafts nothing (a prompt-long chain, never a tree)
        remaining = seq.req.max_new_tokens - len(seq.generated) - 1
        if self.max_context is not None:
            remaining = min(remaining, self.max_context - len(seq.tokens) - 1)
        return remaining

    def _propose(self, drafts: list[DraftRequest]) -> Calls[list[Proposal]]:
        """Step 2: the drafter's proposals; empty for rows that draft nothing this round (a plain row, the last
        token): those never reach the drafter, so it holds no row for a sequence that opted out and ships nothing."""
        ask = [i for i, d in enumerate(drafts) if d.k > 0 or d.tree] if self.drafter is not None else []
        if not ask:
            return [Proposal.empty() for _ in drafts]
        if len(ask) == len(drafts):
            return (yield self.drafter.propose(drafts))
        got = yield self.drafter.propose([drafts[i] for i in ask])
        out = [Proposal.empty() for _ in drafts]
        for i, p in zip(ask, got):
            out[i] = p
        return out

    def prune(self, live: list[SequenceState], proposals: list[Proposal]) -> list[Proposal]:
        """Between propose and verify: drop the deterministic candidates a row's processors ban (core/processors.py),
        so they take no verification slot; rows without processors are passed through untouched."""
        if self.vocab is None or not any(seq.req.processors for seq in live):
            return proposals  # the width is learnt from a full row, which every row with processors asks for
        return [prune_banned(seq.req.processors, seq.tokens, p, self.vocab) if seq.req.processors else p
                for seq, p in zip(live, proposals)]

    def shape_trees(self, live: list[SequenceState], proposals: list[Proposal]) -> list[Proposal]:
        """Between propose and verify: keep each tree's most likely nodes, as many as the modelled cost pays for
        (the same count for every row), never deeper than the sequence can still use."""
        if not self.trees or not any(p.tokens for p in proposals):
            return proposals
        trees = [proposal_tree(p) for p in proposals]
        acc = self.budget.acceptance
        est = [acc.estimate(t) for t in trees]
        cap = self.budget.node_cap(est)
        out = []
        for seq, tree, e in zip(live, trees, est):
            kept = tree.keep(cap, rank=e, max_depth=max(self._remaining(seq), 0))
            out.append(kept.proposal())
        return out

    def score_requests(self, drafts: list[DraftRequest], proposals: list[Proposal]) -> list[ScoreRequest]:
        """Step 3's input: committed + draft tokens, asking for one logit row per draft token plus one (and rows over
        the whole prompt in the first round of a sequence that wants prompt logprobs; that round drafts nothing).
        In a round where no row has draft tokens (plain decoding, every row opted out, or speculation switched off
        for the round), a greedy row asks for up to `plain_steps` tokens in the one call. A row that fills its prompt
        this round: with whole prompts (`prompt_tokens` 0) the round is one pass for everyone, so its first token
        streams right after the prefill; with prompt chunks on, the decoding rows keep their steps and the filling row
        takes them too (its first token waits for them), as vLLM's multi-step scheduling runs prefills in the first
        step: otherwise every round that finishes a chunked prompt would cost the running streams their steps."""
        rows = [seq for seq in (self.seqs.get(d.seq_id) for d in drafts) if seq is not None]
        filling_keeps_steps = self.prompt_tokens > 0 and any(seq.generated for seq in rows)
        plain = self.plain_steps > 1 and not any(p.tokens for p in proposals) and \
            (filling_keeps_steps or all(seq.generated for seq in rows))
        out = []
        for d, p in zip(drafts, proposals):
            n = len(p.tokens) + 1
            seq = self.seqs.get(d.seq_id)
            if self._wants_prompt_rows(seq):
                n += len(d.tokens) - 1
            # A row with processors needs its full rows: the verifier's own argmax would skip them.
            argmax_only = seq is not None and seq.req.params.greedy and seq.req.logprobs is None and \
                not seq.req.prompt_logprobs and not seq.req.processors
            steps = 1
            if plain and argmax_only and not self._wants_prompt_rows(seq):
                steps = 1 + min(self.plain_steps - 1, max(self._remaining(seq), 0))
            # The prompt's rows are reduced to its top-n on the verifier: only O(P x n) numbers come back.
            prompt = PromptScoring(len(d.tokens) - 1, seq.req.logprobs or 0, seq.req.params) \
                if self._wants_prompt_rows(seq) else None
            out.append(ScoreRequest(d.seq_id, d.tokens + p.tokens, n, p.parents if p.tokens else None, argmax_only,
                                    steps, seq.req.stop_token_ids if steps > 1 else (),
                                    seq.req.adapter if seq is not None else "", prompt))
        return out

    @staticmethod
    def _wants_prompt_rows(seq: SequenceState | None) -> bool:
        return seq is not None and seq.req.prompt_logprobs and seq.prompt_logprobs is None

    def commit(
        self, live: list[SequenceState], proposals: list[Proposal], logits: list[torch.Tensor], timing: tuple[float, float]
    ) -> list[StepOutput]:
        """Steps 4-5: accept, append with stops, update policy and metrics, release finished sequences."""
        outputs = []
        for seq, prop, p_logits in zip(live, proposals, logits):
            if seq.req.seq_id not in self.seqs:  # aborted while the round was in flight
                continue
            first_round = self._wants_prompt_rows(seq)
            if first_round:
                p_logits = self._take_prompt_rows(seq, p_logits)
            if p_logits.dim() == 2:
                self.vocab = p_logits.shape[-1]
                if seq.req.processors:  # every row with its own history, before acceptance and logprobs
                    p_logits = process_rows(seq.req.processors, seq.tokens, prop, p_logits)
            gen = round_generator(seq.req.params.seed, len(seq.tokens), "accept")
            path = None  # accepted tree nodes (tree rounds only)
            if prop.is_tree and prop.tokens:
                tree = proposal_tree(prop)
                path, nxt = accept_tree(tree, p_logits, seq.req.params, gen)
                n_acc = len(path)
                on_path = set(path)
                rest = [prop.exits[i] for i in range(len(tree)) if i not in on_path]
                result = RoundResult(len(tree), n_acc, [tree.tokens[i] for i in path] + [nxt],
                                     [prop.exits[i] for i in path] + rest)
                self.budget.observe(tree, path)
            elif not prop.tokens and p_logits.dim() == 1 and len(p_logits) > 1:  # plain steps: the target's own ids
                result = RoundResult(0, 0, p_logits.tolist(), [])
                seq.metrics.num_target_forwards += len(p_logits) - 1
            else:
                n_acc, nxt = self.sampler(prop.tokens, prop.q, p_logits, seq.req.params, gen)
                result = RoundResult(len(prop.tokens), n_acc, prop.tokens[:n_acc] + [nxt], prop.exits)
            emitted = self._append(seq, result.new_tokens)
            logprobs = self._logprobs(seq, emitted_rows(p_logits, len(emitted), path), emitted)
            seq.metrics.record(result, len(emitted))
            seq.metrics.draft_seconds += timing[0]
            seq.metrics.target_seconds += timing[1]
            if seq.metrics.first_token_seconds is None:
                seq.metrics.first_token_seconds = time.perf_counter() - seq.started
            if self.drafter is not None:
                seq.k = self.policy.update(n_acc, seq.k) if result.n_drafted else seq.k
            metrics = None
            if seq.finish_reason is not None:
                seq.metrics.total_seconds = time.perf_counter() - seq.started
                metrics = seq.metrics.to_dict()
                if self.suffix is not None and seq.req.speculate:  # an opted-out request neither reads nor adds
                    self.suffix.finished(seq.req.suffix_scope, seq.req.prompt_ids, seq.generated)
                del self.seqs[seq.req.seq_id]
                self._release(seq.req.seq_id)
            outputs.append(StepOutput(seq.req.seq_id, emitted, seq.finish_reason is not None, seq.finish_reason,
                                      metrics, logprobs, seq.prompt_logprobs if first_round else None))
        return outputs

    @staticmethod
    def _take_prompt_rows(seq: SequenceState, p_logits: torch.Tensor | ScoredPrompt) -> torch.Tensor:
        """Split the first round's rows: P-1 over the prompt (kept as prompt logprobs), then the round's own. The
        verifier reduced the prompt's rows (a ScoredPrompt); a verifier that answered full rows has them reduced
        here, by the same rule."""
        if isinstance(p_logits, ScoredPrompt):
            seq.prompt_logprobs = scored_prompt_logprobs(p_logits, seq.req.prompt_ids)
            return p_logits.logits
        n_prompt = len(seq.req.prompt_ids) - 1
        seq.prompt_logprobs = prompt_logprobs(p_logits[:n_prompt], seq.req.prompt_ids, seq.req.params,
                                              seq.req.logprobs or 0)
        return p_logits[n_prompt:]

    @staticmethod
    def _logprobs(seq: SequenceState, rows: torch.Tensor, emitted: list[int]) -> list[TokenLogprob] | None:
        if seq.req.logprobs is None:
            return None
        out = token_logprobs(rows, emitted, seq.req.params, seq.req.logprobs)
        seq.logprobs.extend(out)
        return out

    def _append(self, seq: SequenceState, new_tokens: list[int]) -> list[int]:
        emitted = []
        for tok in new_tokens:
            seq.generated.append(tok)
            emitted.append(tok)
            if tok in seq.req.stop_token_ids:
                seq.finish_reason = "stop"
            elif len(seq.generated) >= seq.req.max_new_tokens:
                seq.finish_reason = "length"
            elif self.max_context is not None and len(seq.tokens) >= self.max_context:
                seq.finish_reason = "length"
            if seq.finish_reason:
                break
        if seq.stops is not None:
            cut = seq.stops.extend(emitted)
            if cut is not None:
                drop = len(seq.generated) - cut
                del seq.generated[cut:]
                emitted = emitted[: max(len(emitted) - drop, 0)]
                seq.finish_reason = "stop"
        return emitted

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Decode all requests together until each finishes; results in request order."""
        for req in requests:
            self.add_request(req)
        done: dict[str, SequenceState] = {}
        tracked = {r.seq_id: self.seqs[r.seq_id] for r in requests}
        while self.has_unfinished:
            for out in self.step():
                if out.finished:
                    done[out.seq_id] = tracked[out.seq_id]
        return [
            GenerationResult(r.seq_id, s.generated, s.finish_reason or "abort", s.metrics.to_dict(),
                             logprobs=s.logprobs if r.logprobs is not None else None,
                             prompt_logprobs=s.prompt_logprobs)
            for r in requests
            for s in [done[r.seq_id]]
        ]
