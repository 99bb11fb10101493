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
Since speculation is lossless and every emitted token was chosen from a target row, the values are the target's
whether speculation is on or off; no extra forward is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import filtered_logits
from .types import SamplingParams


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


def token_logprobs(logits: torch.Tensor, tokens: list[int], params: SamplingParams, top_n: int) -> list[TokenLogprob]:
    """Row i of logits: [m, V] scores tokens[i]; returns its logprob and the top_n alternatives (0: none)."""
    if not tokens:
        return []
    logp = log_distribution(logits[: len(tokens)], params)  # [m, V]
    idx = torch.tensor(tokens, device=logp.device)
    chosen = logp[torch.arange(len(tokens), device=logp.device), idx].tolist()
    if top_n > 0:
        values, ids = torch.topk(logp, min(top_n, logp.shape[-1]), dim=-1)  # [m, top_n]
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, c, top) for t, c, top in zip(tokens, chosen, tops)]


def prompt_logprobs(logits: torch.Tensor, prompt: list[int], params: SamplingParams,
                    top_n: int) -> list[TokenLogprob | None]:
    """Logprobs of prompt tokens 1.. from rows 0..P-2 of logits: [>= P-1, V]; the first token has none (None)."""
    return [None, *token_logprobs(logits[: len(prompt) - 1], prompt[1:], params, top_n)]
