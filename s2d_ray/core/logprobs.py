"""The target's log-probabilities of emitted (and prompt) tokens, from the logit rows verification already computed.

Which distribution (as vLLM documents its choice):
- sampling (temperature > 0): the distribution the sampler drew from, log of `sampling.logits_to_probs`: logits /
  temperature, tokens outside top-k / top-p at -inf. A chosen token always has a finite logprob; alternatives past
  the filter are -inf (the HTTP layer clamps them to -9999.0, as vLLM does).
- greedy (temperature 0): the raw model distribution, log_softmax of the logits (the sampler's one-hot would say
  0 / -inf and nothing else). This is vLLM's default (`logprobs_mode="raw_logprobs"`).
A request's logits processors (penalties, logit_bias, bans, a grammar: core/processors.py) come first: a completion
token's logprob is taken from its row AFTER processing, the distribution it was chosen from (a banned alternative is
-inf). Prompt tokens use the same rule as the completion's tokens of that request, on the raw rows (processors shape
what is generated, not how the prompt scores).
Prompt rows are reduced where the logits are (the verifier, for a ScoreRequest with `prompt`; `reduce_rows`): only
each token's logprob and its top-n leave it, by the same rules as here.
Since speculation is lossless and every emitted token was chosen from a target row, the values are the target's
whether speculation is on or off; no extra forward is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .sampling import filtered_logits
from .types import SamplingParams, ScoredPrompt

# Prompt rows whose logits a verifier holds at once while reducing them (reduce_rows): 256 rows of a 152k vocabulary
# in float32 are 156 MB.
REDUCE_BLOCK = 256


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the `top` most likely alternatives (id, logprob), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities per row as documented above; logits: [m, V] -> [m, V] (float64 stays float64)."""
    if params.greedy:
        x = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
        return x.log_softmax(-1)
    return filtered_logits(logits, params).log_softmax(-1)


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, params: SamplingParams,
                 top_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row i of logits: [m, V] scores tokens[i] ([m] long) -> (its logprob [m], top_n ids [m, top_n], their logprobs
    [m, top_n]): everything a TokenLogprob needs, as tensors (what a verifier ships for prompt rows)."""
    logp = log_distribution(logits, params)  # [m, V]
    chosen = logp.gather(-1, tokens.to(logp.device)[:, None])[:, 0]
    if top_n > 0:
        values, ids = torch.topk(logp, min(top_n, logp.shape[-1]), dim=-1)  # [m, top_n]
    else:
        values = logp.new_empty((len(logp), 0))
        ids = torch.empty((len(logp), 0), dtype=torch.long, device=logp.device)
    return chosen, ids, values


def as_logprobs(tokens: list[int], chosen: torch.Tensor, ids: torch.Tensor,
                values: torch.Tensor) -> list[TokenLogprob]:
    """TokenLogprobs from `logprob_rows`'s tensors."""
    tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return [TokenLogprob(t, c, top) for t, c, top in zip(tokens, chosen.tolist(), tops)]


def token_logprobs(logits: torch.Tensor, tokens: list[int], params: SamplingParams, top_n: int) -> list[TokenLogprob]:
    """Row i of logits: [m, V] scores tokens[i]; returns its logprob and the top_n alternatives (0: none)."""
    if not tokens:
        return []
    idx = torch.tensor(tokens, device=logits.device)
    return as_logprobs(tokens, *logprob_rows(logits[: len(tokens)], idx, params, top_n))


def prompt_logprobs(logits: torch.Tensor, prompt: list[int], params: SamplingParams,
                    top_n: int) -> list[TokenLogprob | None]:
    """Logprobs of prompt tokens 1.. from rows 0..P-2 of logits: [>= P-1, V]; the first token has none (None)."""
    return [None, *token_logprobs(logits[: len(prompt) - 1], prompt[1:], params, top_n)]


def scored_prompt_logprobs(scored: ScoredPrompt, prompt: list[int]) -> list[TokenLogprob | None]:
    """`prompt_logprobs` from a verifier's reduced rows (ScoredPrompt, rows 0..P-2 scoring tokens 1..P-1)."""
    n = len(prompt) - 1
    return [None, *as_logprobs(prompt[1:], scored.chosen[:n], scored.top_ids[:n], scored.top_logprobs[:n])]


def reduce_rows(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, tokens: list[int],
                params: SamplingParams, top_n: int, block: int | None = None) -> tuple[torch.Tensor, ...]:
    """`logprob_rows` over hidden states [m, h] whose logits `head` computes, `block` rows at a time: a long prompt
    never holds more than block x V logits at once (`block` None: REDUCE_BLOCK)."""
    block = block or REDUCE_BLOCK
    parts = []
    for a in range(0, len(hidden), block):
        idx = torch.tensor(tokens[a : a + block], dtype=torch.long, device=hidden.device)
        parts.append(logprob_rows(head(hidden[a : a + block]), idx, params, top_n))
    if not parts:
        return logprob_rows(head(hidden[:0]), torch.empty(0, dtype=torch.long), params, top_n)
    return tuple(torch.cat(x) for x in zip(*parts))


def emitted_rows(p_logits: torch.Tensor, n_emitted: int, path: list[int] | None = None) -> torch.Tensor:
    """The target rows the round's emitted tokens were chosen from -> [n_emitted, V].

    Chain (path None; p_logits [k+1, V]): row i scores the token after committed + draft[:i], and the emitted tokens
    are accepted drafts then the recovered/bonus token, so they are the first n_emitted rows. Tree (p_logits
    [1 + n, V], row 0 at the root, row 1 + i after node i): the root row, then the rows after each accepted node.
    """
    if path is None:
        return p_logits[:n_emitted]
    return p_logits[[0] + [i + 1 for i in path]][:n_emitted]
