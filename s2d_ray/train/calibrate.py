"""Per-target calibration: measure each exit's acceptance (along the target's own greedy path) and cost, then pick
the thresholds and draft-length policy that maximise modelled speedup for that target.

Acceptance is exact for greedy decoding (see validate.py). Costs are measured on this machine at batch 1: one draft
token leaving at exit i costs its layers plus one LM-head per exit it passed; one verification of n tokens costs
t_verify(n). Modelled speedup = tokens x t_verify(1) / (draft time + verification time), plain decoding = 1.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from ..core.draft import SortedDraft, SortedDrafter
from ..core.target import TargetVerifier
from ..core.types import DraftRequest, SamplingParams, ScoreRequest
from .validate import PathPreds, adaptive_correct

logger = logging.getLogger(__name__)

TAU_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.01)  # 1.01: never leave at this exit
POLICIES = tuple([("fixed", k) for k in range(1, 9)] + [("heuristic", 3), ("heuristic", 5)])


@dataclass
class Costs:
    """Seconds: per exit, a draft token that leaves there (its layers + one head); one extra head; verify(n)."""

    exit_token: list[float]
    head: float
    verify: dict[int, float]

    def draft_token(self, exit_index: int) -> float:
        return self.exit_token[exit_index] + exit_index * self.head

    def verify_n(self, n: int) -> float:
        keys = sorted(self.verify)
        lo = max([k for k in keys if k <= n], default=keys[0])
        hi = min([k for k in keys if k >= n], default=keys[-1])
        if hi == lo:
            return self.verify[lo] * (n / lo if n > hi else 1.0)
        return self.verify[lo] + (self.verify[hi] - self.verify[lo]) * (n - lo) / (hi - lo)


def simulate_timed(correct: list[bool], exits: list[int], costs: Costs, policy: str, k: int,
                   max_k: int = 16) -> tuple[int, int, float]:
    """(tokens, rounds, seconds) of greedy speculation along one path; off-path draft tokens cost like the last."""
    t, rounds, secs, cur = 0, 0, 0.0, k
    n = len(correct)
    while t < n:
        run = 0
        while run < cur and t + run < n and correct[t + run]:
            run += 1
        drafted = min(cur, n - t)
        on_path = [exits[min(t + j, n - 1)] for j in range(min(run + 1, drafted))]
        off_path = (drafted - len(on_path)) * costs.draft_token(on_path[-1] if on_path else 0)
        secs += sum(costs.draft_token(e) for e in on_path) + off_path
        secs += costs.verify_n(drafted + 1)
        if policy == "heuristic":
            cur = min(cur + 2, max_k) if run == cur else max(cur - 1, 1)
        t += run + 1
        rounds += 1
    return n, rounds, secs


def search(preds: list[PathPreds], exit_layers: list[int], costs: Costs, grid=TAU_GRID, policies=POLICIES,
           max_k: int = 16) -> list[dict]:
    """Every (thresholds, policy) on the grid, ranked by modelled speedup (best first)."""
    results = []
    inner = len(exit_layers) - 1
    for taus in itertools.product(grid, repeat=inner):
        thresholds = [*taus, 0.0]
        paths = [adaptive_correct(p, thresholds) for p in preds]
        for policy, k in policies:
            tokens = rounds = 0
            secs = 0.0
            for correct, chosen in paths:
                a, b, c = simulate_timed(correct, chosen, costs, policy, k, max_k)
                tokens, rounds, secs = tokens + a, rounds + b, secs + c
            results.append({"thresholds": [min(x, 1.0) for x in thresholds], "policy": policy, "k": k,
                            "mat": tokens / max(rounds, 1), "speedup": tokens * costs.verify_n(1) / max(secs, 1e-12)})
    return sorted(results, key=lambda r: -r["speedup"])


def _timeit(fn, repeat: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


@torch.no_grad()
def measure_costs(draft: SortedDraft, target_model, prompt: list[int], repeat: int = 5, k: int = 8) -> Costs:
    """Batch-1 wall time per draft token at each single exit, of one LM head, and of verifying n tokens."""
    exit_token = []
    for e in draft.spec.exit_layers:
        drafter = SortedDrafter(draft.with_exits([e], [0.0]))
        # Alternate the last token so every call recomputes it plus k drafted positions (as after a verification).
        reqs = [[DraftRequest("c", list(prompt[:-1]) + [last], k, SamplingParams())] for last in prompt[-2:]]
        flip = itertools.cycle(reqs)
        exit_token.append(_timeit(lambda: drafter.propose(next(flip)), repeat) / k)
    h = torch.zeros(1, draft.parts.embed.weight.shape[1], dtype=draft.stack.dtype)
    head = _timeit(lambda: draft.stack.logits(h), repeat * 4)
    verifier = TargetVerifier(target_model)
    verifier.score([ScoreRequest("v", list(prompt), 1)])
    verify = {}
    for n in (1, 2, 4, 8, 12, 17):
        toks = list(prompt) + [int(prompt[-1])] * (n - 1)
        verify[n] = _timeit(lambda: verifier.score([ScoreRequest("v", toks, n)]), repeat)
    return Costs(exit_token, head, verify)
