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
from dataclasses import dataclass, field, replace
from statistics import median

import torch

from ..build import build_drafter, build_verifier
from ..core.draft import SortedDraft
from ..core.kernels import Kernels
from ..core.types import DraftRequest, SamplingParams, ScoreRequest
from ..fleet.measure import sync
from .validate import PathPreds, adaptive_correct

logger = logging.getLogger(__name__)

# 0.0: always leave at this exit (where a cheap exit agrees about as often as the deep ones, leaving there at once
# can model best, so the search must be able to stop there); 1.01: never leave there
TAU_GRID = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.01)
POLICIES = tuple([("fixed", k) for k in range(1, 9)] + [("heuristic", 3), ("heuristic", 5)])


GRID_BATCHES = (1, 2, 4, 8, 16)
GRID_POSITIONS = (1, 2, 4, 8, 12, 16, 24, 32)
DRAFT_ROW_BATCH = 8


def context_ids(prompts: list[list[int]], length: int) -> list[int]:
    """`length` tokens of the prompts concatenated (repeated as needed): costs depend on the context's length, not on
    its tokens."""
    ids = [t for p in prompts for t in p]
    while len(ids) < length + 2:
        ids = ids + ids
    return ids[:length]


@dataclass
class Costs:
    """Seconds: per exit, a draft token that leaves there (its layers + one head); one extra head; verify(n) at batch
    1; verify_grid[B][n] (B rows of n positions each, one forward); draft_row: what each extra row adds to a draft
    step (deepest exit)."""

    exit_token: list[float]
    head: float
    verify: dict[int, float]
    verify_grid: dict[int, dict[int, float]] = field(default_factory=dict)
    draft_row: float = 0.0

    def draft_token(self, exit_index: int) -> float:
        return self.exit_token[exit_index] + exit_index * self.head

    def verify_n(self, n: int) -> float:
        keys = sorted(self.verify)
        lo = max([k for k in keys if k <= n], default=keys[0])
        hi = min([k for k in keys if k >= n], default=keys[-1])
        if hi == lo:
            return self.verify[lo] * (n / lo if n > hi else 1.0)
        return self.verify[lo] + (self.verify[hi] - self.verify[lo]) * (n - lo) / (hi - lo)

    @classmethod
    def from_profile(cls, costs_ms: dict) -> "Costs":
        """What `to_profile` wrote (a profile's `costs_ms`), back in seconds."""
        sec = lambda row: {int(n): ms / 1e3 for n, ms in row.items()}  # noqa: E731
        return cls([ms / 1e3 for ms in costs_ms["exit_token"]], costs_ms.get("extra_head", 0.0) / 1e3,
                   sec(costs_ms["verify"]), {int(b): sec(row) for b, row in costs_ms.get("verify_grid", {}).items()},
                   costs_ms.get("draft_row", 0.0) / 1e3)

    def to_profile(self) -> dict:
        """The profile's `costs_ms`, as core/costs.py `CostModel.from_profile` reads it."""
        out = {"exit_token": [round(1e3 * c, 3) for c in self.exit_token], "extra_head": round(1e3 * self.head, 3),
               "verify": {str(n): round(1e3 * t, 3) for n, t in sorted(self.verify.items())},
               "draft_row": round(1e3 * self.draft_row, 3)}
        if self.verify_grid:
            out["verify_grid"] = {str(b): {str(n): round(1e3 * t, 3) for n, t in sorted(row.items())}
                                  for b, row in sorted(self.verify_grid.items())}
        return out


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
           max_k: int = 16, thresholds: list[float] | None = None) -> list[dict]:
    """Every (thresholds, policy) on the grid (or the given thresholds only), ranked by modelled speedup (best
    first)."""
    results = []
    settings = [list(thresholds)] if thresholds else [[*taus, 0.0] for taus in
                                                      itertools.product(grid, repeat=len(exit_layers) - 1)]
    for taus in settings:
        paths = [adaptive_correct(p, taus) for p in preds]
        for policy, k in policies:
            tokens = rounds = 0
            secs = 0.0
            for correct, chosen in paths:
                a, b, c = simulate_timed(correct, chosen, costs, policy, k, max_k)
                tokens, rounds, secs = tokens + a, rounds + b, secs + c
            results.append({"thresholds": [min(x, 1.0) for x in taus], "policy": policy, "k": k,
                            "mat": tokens / max(rounds, 1), "speedup": tokens * costs.verify_n(1) / max(secs, 1e-12)})
    return sorted(results, key=lambda r: -r["speedup"])


def fixed_exits(preds: list[PathPreds], exit_layers: list[int], costs: Costs, policies=POLICIES,
                max_k: int = 16) -> dict[str, dict]:
    """Each single exit on its own (what `exit:<L>` runs: its layers and one head, no earlier exits' heads), with its
    best draft-length policy: the settings the adaptive draft must beat for the sorted draft to pay."""
    out = {}
    for i, layer in enumerate(exit_layers):
        always_i = [1.01] * i + [0.0] * (len(exit_layers) - i)  # never leave before exit i, always at it
        best = search(preds, exit_layers, replace(costs, head=0.0), policies=policies, max_k=max_k,
                      thresholds=always_i)[0]
        out[str(layer)] = {"policy": best["policy"], "k": best["k"], "mat": round(best["mat"], 4),
                           "speedup": round(best["speedup"], 4)}
    return out


def _timeit(fn, repeat: int) -> float:
    """Median seconds of `repeat` calls after one warm-up (medians resist the other jobs on a shared machine)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


@torch.no_grad()
def measure_verify_grid(target_model, context: list[int], batches=GRID_BATCHES, positions=GRID_POSITIONS,
                        repeat: int = 5,
                        kernels: Kernels | None = None) -> dict[int, dict[int, float]]:
    """Seconds of one target forward over B rows of n positions each, every row's KV prefilled to `context`.

    Each B gets a fresh verifier (the cache holds exactly B rows, as in an engine with B active sequences). Repeats
    sweep all n in turn, so a burst of load elsewhere spreads over the grid instead of landing on one point."""
    extra = (list(context[::-1]) * (max(positions) // max(len(context), 1) + 1))[: max(positions)]
    grid: dict[int, dict[int, float]] = {}
    for b in batches:
        verifier = build_verifier(target_model, kernels=kernels)
        ids = [f"g{i}" for i in range(b)]
        for i in range(0, b, 4):  # prefill in chunks: bounded memory for the [rows, heads, q, kv] mask
            verifier.score([ScoreRequest(s, list(context), 1) for s in ids[i : i + 4]])
        reqs = {n: [ScoreRequest(s, list(context) + extra[:n], n) for s in ids] for n in positions}
        for n in positions:  # warm-up
            verifier.score(reqs[n])
        times: dict[int, list[float]] = {n: [] for n in positions}
        for _ in range(repeat):
            for n in positions:
                start = time.perf_counter()
                verifier.score(reqs[n])
                sync(verifier.stack.device)  # CUDA runs asynchronously: time the work, not its launch
                times[n].append(time.perf_counter() - start)
        grid[b] = {n: median(t) for n, t in times.items()}
        logger.info("verify grid batch %d: %s ms", b, {n: round(1e3 * t, 2) for n, t in grid[b].items()})
    return grid


def _draft_depth(draft: SortedDraft, context: list[int], rows: int, repeat: int, k: int) -> float:
    """Seconds per draft depth (one token per row) for `rows` sequences: propose k tokens from a recomputed last
    token (alternated, as after a verification), divided by k."""
    drafter = build_drafter(draft)
    flips = [[DraftRequest(f"d{i}", list(context[:-1]) + [last], k, SamplingParams()) for i in range(rows)]
             for last in (context[-1], next(t for t in context if t != context[-1]))]
    flip = itertools.cycle(flips)
    return _timeit(lambda: drafter.propose(next(flip)), repeat) / k


@torch.no_grad()
def measure_costs(draft: SortedDraft, target_model, context: list[int], repeat: int = 5, k: int = 8,
                  batches=GRID_BATCHES, positions=GRID_POSITIONS) -> Costs:
    """Per draft token at each single exit, one LM head, the verify grid (batch x positions), and the draft's
    per-row cost, all at the given context (KV prefilled); passes on the draft's kernels and threads, as the engine
    runs them."""
    exit_token = [_draft_depth(draft.with_exits([e], [0.0]), context, 1, repeat, k) for e in draft.spec.exit_layers]
    h = torch.zeros(1, draft.parts.embed.weight.shape[1], dtype=draft.stack.dtype)
    head = _timeit(lambda: draft.stack.logits(h), repeat * 4)
    if 1 not in batches:
        raise ValueError("the verify grid needs batch 1 (plain decoding's cost)")
    grid = measure_verify_grid(target_model, context, batches, positions, repeat, draft.kernels)
    deepest = draft.with_exits([draft.spec.exit_layers[-1]], [0.0])
    many = _draft_depth(deepest, context, DRAFT_ROW_BATCH, repeat, k)
    draft_row = max(many - exit_token[-1], 0.0) / (DRAFT_ROW_BATCH - 1)
    return Costs(exit_token, head, dict(grid[1]), grid, draft_row)
