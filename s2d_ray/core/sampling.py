"""Token selection and the speculative acceptance rule (Leviathan et al. 2023; Chen et al. 2023).

Names follow the paper: `p` is the target distribution, `q` the draft distribution, `k` the number of draft tokens.
Terms: *accepted* draft tokens are kept; on the first rejection a *recovered* token is drawn from norm(max(0, p - q));
when all k are accepted a *bonus* token is drawn from p. Either way exactly one target token ends the round.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import torch

from .types import SamplingParams


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Softmax after temperature, top-k and top-p (in that order, as in transformers); logits: [..., V]."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(_prob_dtype(logits))
    return filtered_logits(logits, params).softmax(-1)


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits / temperature with tokens outside top-k / top-p set to -inf (sampling only); logits: [..., V]."""
    x = logits.to(_prob_dtype(logits)) / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = sorted_x.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p; the top token always stays.
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def _prob_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def round_generator(seed: int | None, position: int, role: str) -> torch.Generator | None:
    """A generator for one round, derived from (request seed, sequence position, role).

    Stateless derivation makes sampled output reproducible whatever the batching, replica or restart.
    """
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:{position}:{role}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from probs: [V] (on CPU so that seeded draws match on every device)."""
    return int(torch.multinomial(probs.detach().cpu().float(), 1, generator=generator))


def argmax_ids(scores: torch.Tensor) -> list[int]:
    """Each row's argmax; `scores` may already be those ids ([n] integers: a verifier's answer to `argmax_only`)."""
    return scores.tolist() if scores.dim() == 1 else scores.argmax(-1).tolist()


def compact_scores(logits: torch.Tensor, argmax_only: bool) -> torch.Tensor:
    """What a remote verifier ships back: the argmax ids when that is all the caller needs, else the logits."""
    return logits.argmax(-1) if argmax_only else logits


def greedy_verify(draft_tokens: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy acceptance: keep the longest prefix equal to the target's argmax; target_logits: [k+1, V] (or the
    argmax ids [k+1])."""
    best = argmax_ids(target_logits)
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == best[n]:
        n += 1
    return n, best[n]


class Sampler(Protocol):
    def __call__(
        self,
        draft_tokens: list[int],
        q: torch.Tensor | None,
        target_logits: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> tuple[int, int]: ...


def rejection_sample(
    draft_tokens: list[int],
    q: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Return (n_accepted, next_token). q: [k, V] or None for a one-hot (greedily drafted) q; target_logits: [k+1, V].

    Each draft token x is kept with probability min(1, p(x)/q(x)); the first rejected one is replaced by a draw from
    norm(max(0, p - q)); if all are kept a bonus token is drawn from p. The output then follows p exactly.
    """
    if params.greedy:
        return greedy_verify(draft_tokens, target_logits)
    k = len(draft_tokens)
    p = logits_to_probs(target_logits, params)  # [k+1, V]
    if k == 0:
        return 0, sample(p[0], generator)
    idx = torch.tensor(draft_tokens, device=p.device)
    if q is None:
        q = torch.nn.functional.one_hot(idx, p.shape[-1]).to(p.dtype)
    q = q.to(p.device, p.dtype)
    rows = torch.arange(k, device=p.device)
    p_x, q_x = p[rows, idx], q[rows, idx]
    accept_prob = torch.where(q_x > 0, (p_x / q_x.clamp_min(1e-30)).clamp(max=1.0), torch.zeros_like(p_x))
    u = torch.rand(k, generator=generator, dtype=torch.float64).to(p.device)
    rejected = (u >= accept_prob.double()).nonzero()
    if len(rejected) == 0:
        return k, sample(p[k], generator)
    n = int(rejected[0])
    residual = (p[n] - q[n]).clamp_min(0)
    total = residual.sum()
    return n, sample(residual / total if total > 0 else p[n], generator)
