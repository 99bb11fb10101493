"""How much to speculate this round: tree shape from configuration, size from measured costs and acceptance.

Round time ~= verify(B, n) + depth * draft(B); tokens per row ~= 1 + sum over verified nodes of P(node accepted).
With a cost model (calibration) the engine picks, every round, the draft depth that maximises modelled tokens per
second for the whole batch, then keeps the best n nodes per row for the same reason (n = 0 is plain decoding). As the
batch grows, verify(B, n) grows with B * n and the same rule shrinks trees to nothing; it grows them back when load
drops. Acceptance probabilities are learned online from this engine's own rounds (priors only until data arrives).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .costs import CostModel
from .tree import LOOKUP, TokenTree

SCORE_EDGES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.01)  # upper edges of draft-score bins
MAX_LOOKUP_DEPTH = 32


@dataclass(frozen=True)
class TreeShape:
    """What a tree may hold: `width` draft candidates per depth, lookup candidates, at most `max_nodes` nodes."""

    width: int = 1
    lookup: bool = False
    max_nodes: int = 24


class AcceptanceModel:
    """P(the path to a node is accepted), by the node's draft path probability (binned) or its lookup depth.

    Counts start from priors worth `prior_weight` observations (draft: 0.8 x the bin's score; lookup: 0.5 x 0.8^d),
    then follow what this engine's rounds accepted.
    """

    def __init__(self, prior_weight: float = 4.0) -> None:
        lows = (0.0,) + SCORE_EDGES[:-1]
        centres = [(lo + min(hi, 1.0)) / 2 for lo, hi in zip(lows, SCORE_EDGES)]
        self.draft = [[0.8 * c * prior_weight, prior_weight] for c in centres]  # [accepted, offered] per bin
        self.lookup = [[0.5 * 0.8 ** d * prior_weight, prior_weight] for d in range(MAX_LOOKUP_DEPTH)]

    @staticmethod
    def _bin(score: float) -> int:
        return min(bisect.bisect_right(SCORE_EDGES, score), len(SCORE_EDGES) - 1)

    def _lookup_p(self, depth: int) -> float:
        acc, off = self.lookup[min(depth, MAX_LOOKUP_DEPTH) - 1]
        return acc / off

    def estimate(self, tree: TokenTree) -> list[float]:
        depths = tree.depths()
        est = []
        for ex, score, d in zip(tree.exits, tree.scores, depths):
            a, o = self.draft[self._bin(score)]
            p = a / o if score > 0 else 0.0
            if ex == LOOKUP:
                p = max(p, self._lookup_p(d))
            est.append(p)
        # A node is never likelier than its parent (the path must be accepted first).
        for i, par in enumerate(tree.parents):
            if par >= 0:
                est[i] = min(est[i], est[par])
        return est

    def observe(self, tree: TokenTree, path: list[int]) -> None:
        on_path = set(path)
        for i, (ex, score, d) in enumerate(zip(tree.exits, tree.scores, tree.depths())):
            hit = float(i in on_path)
            if score > 0:
                cell = self.draft[self._bin(score)]
                cell[0] += hit
                cell[1] += 1
            if ex == LOOKUP:
                cell = self.lookup[min(d, MAX_LOOKUP_DEPTH) - 1]
                cell[0] += hit
                cell[1] += 1


class SpeculationBudget:
    """Per round: the draft depth for the batch, and how many nodes each row keeps (cost-based when costs exist)."""

    def __init__(self, shape: TreeShape, costs: CostModel | None, max_depth: int) -> None:
        self.shape, self.costs, self.max_depth = shape, costs, max_depth
        self.acceptance = AcceptanceModel()
        # P(accepted path length >= d) for rounds that drafted at least d deep (prior 0.5^d), [hits, rounds].
        self.reach = [[0.5 ** (d + 1) * 4.0, 4.0] for d in range(max_depth)]

    @property
    def load_aware(self) -> bool:
        return self.costs is not None

    def depth(self, batch: int, default: int) -> int:
        """The draft depth that maximises modelled tokens/s for `batch` rows (the policy's k without costs)."""
        if self.costs is None:
            return default
        width = max(self.shape.width, 1)
        best_d, best_rate = 0, batch / self.costs.verify(batch, 1 + self._lookup_nodes())
        tokens = 1.0
        for d in range(1, self.max_depth + 1):
            hits, rounds = self.reach[d - 1]
            tokens += hits / rounds
            # Siblings add roughly what the spine misses at each depth; counted as width-1 extra positions.
            n = 1 + d * width + self._lookup_nodes()
            secs = self.costs.verify(batch, n) + d * self.costs.draft(batch)
            rate = batch * tokens / secs
            if rate > best_rate * 1.01:
                best_d, best_rate = d, rate
        return best_d

    def _lookup_nodes(self) -> int:
        return 4 if self.shape.lookup else 0

    def node_cap(self, estimates: list[list[float]]) -> int:
        """Nodes per row (the same for every row: a batch is as wide as its widest row) that maximise modelled
        tokens per verification second; 0 means a plain decoding step."""
        cap = self.shape.max_nodes
        if self.costs is None:
            return cap
        batch = max(len(estimates), 1)
        ranked = [sorted(e, reverse=True) for e in estimates]
        widest = max((len(r) for r in ranked), default=0)
        best_n, best_rate = 0, batch / self.costs.verify(batch, 1)
        gained = 0.0
        for n in range(1, min(cap, widest) + 1):
            gained += sum(r[n - 1] for r in ranked if len(r) >= n)
            rate = (batch + gained) / self.costs.verify(batch, n + 1)
            if rate > best_rate:
                best_n, best_rate = n, rate
        return best_n

    def observe(self, drafted_depth: int, accepted: int, tree: TokenTree | None, path: list[int]) -> None:
        for d in range(min(drafted_depth, self.max_depth)):
            cell = self.reach[d]
            cell[0] += float(accepted > d)
            cell[1] += 1
        if tree is not None:
            self.acceptance.observe(tree, path)
