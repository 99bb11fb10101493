"""Measured costs of one round, so speculation can size itself against the batch it runs in.

A round costs one target forward over B rows of n positions each (verification; n = 1 is a plain decode step) plus
the draft's work. On every machine measured so far, width is cheap until the matmuls stop being weight-bound: the
curve is flat in n at small B*n and grows with B*n beyond. Calibration measures a grid of (B, n) per dtype
(`verify_ms`); where only batch 1 was measured, a forward of B x n positions is taken to cost what B*n positions cost
at batch 1 (the same number of tokens through the same weights), which is what makes speculation shrink under load.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear in x; beyond the last point, linear through the last two (cost keeps growing with work)."""
    if len(xs) == 1:
        return ys[0] * max(x / xs[0], 1.0)
    if x <= xs[0]:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return ys[i]
    if i >= len(xs):
        i = len(xs) - 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class CostModel:
    """verify_ms[B][n]: ms of one target forward over B rows of n positions; draft_ms[i]: one draft token leaving
    at exit i (batch 1, its layers and heads), ms; draft_row_ms: what each extra row adds to a draft step."""

    verify_ms: dict[int, dict[int, float]]
    draft_ms: list[float] = field(default_factory=list)
    draft_row_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.verify_ms or 1 not in self.verify_ms or not self.verify_ms[1]:
            raise ValueError("a cost model needs at least batch-1 verification costs")

    def verify(self, batch: int, positions: int) -> float:
        """ms of one target forward over `batch` rows of `positions` positions (positions = the widest row)."""
        batch, positions = max(batch, 1), max(positions, 1)
        grid = self.verify_ms
        if len(grid) == 1 or batch == 1:
            row = grid[1]
            xs = sorted(row)
            return _interp(xs, [row[x] for x in xs], batch * positions)
        bs = sorted(grid)
        # Interpolate each measured batch over positions, then across batches.
        at_b = []
        for b in bs:
            xs = sorted(grid[b])
            at_b.append(_interp(xs, [grid[b][x] for x in xs], positions))
        return _interp(bs, at_b, batch)

    def step(self, batch: int = 1) -> float:
        """One plain decode step for `batch` rows."""
        return self.verify(batch, 1)

    def draft(self, batch: int, exit_index: int | None = None) -> float:
        """One draft depth (one token per row) for `batch` rows leaving at `exit_index` (default: the deepest)."""
        if not self.draft_ms:
            return 0.0
        i = len(self.draft_ms) - 1 if exit_index is None else exit_index
        return self.draft_ms[i] + self.draft_row_ms * (max(batch, 1) - 1)

    @classmethod
    def from_profile(cls, profile: dict) -> "CostModel | None":
        """From a calibration profile's `costs_ms` (`verify_grid` by batch if measured, else batch-1 `verify`)."""
        costs = (profile or {}).get("costs_ms")
        if not costs:
            return None
        grid = costs.get("verify_grid") or {"1": costs.get("verify", {})}
        verify = {int(b): {int(n): float(ms) for n, ms in row.items()} for b, row in grid.items() if row}
        if 1 not in verify:
            return None
        exits = [float(x) for x in costs.get("exit_token", [])]
        head = float(costs.get("extra_head", 0.0))
        draft = [ms + i * head for i, ms in enumerate(exits)]
        return cls(verify, draft, float(costs.get("draft_row", 0.0)))
