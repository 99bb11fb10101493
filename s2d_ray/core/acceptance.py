"""How likely a tree's nodes are to be accepted, learned online from what this engine's rounds accepted.

The budget ranks nodes by these estimates and keeps as many as the modelled cost pays for (core/budget.py). Draft
nodes are valued by the draft's path probability (binned), lookup nodes by their depth and the length of the suffix
their match ended with; estimates start from priors and follow the counts.
"""

from __future__ import annotations

import bisect

from .tree import LOOKUP, TokenTree, is_lookup

SCORE_EDGES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.01)  # upper edges of draft-score bins
MAX_LOOKUP_DEPTH = 32


class AcceptanceModel:
    """P(the path to a node is accepted), by the node's draft path probability (binned) or its lookup depth (the
    first continuation by the length of the suffix it matched, and the other, older occurrences' branches apart).

    Counts start from priors worth `prior_weight` observations (draft: 0.8 x the bin's score; lookup: LOOKUP_PRIORS;
    branches 0.15 x 0.7^d), then follow what this engine's rounds accepted.
    """

    # Matched suffix length (1..4, 4 = longer too; 0 = not recorded) -> (P(first token accepted), ratio per deeper
    # token), from replaying lookup on held-out greedy paths. A continuation after a 4-token match is right about
    # three times as often as one after a 1-token match: one estimate for both kept the 1-token matches' nodes where
    # they cost more than they yield, or dropped the 4-token ones where they pay.
    # The last entry: a match of at least LONG_MATCH tokens, kept apart from 4-grams. Such a match is mostly a text
    # repeated whole (the store of earlier outputs proposes alone from the same length, core/suffix.py) and runs on for
    # its whole continuation; valued with the 4-grams, whose continuations in new text soon diverge, a repeat's
    # nodes past the first few ranked low, were never verified there, so their estimates never rose: a repeat of a
    # finished answer at batch 8 verified 4 of the store's 16 nodes a round and accepted all 4.
    LOOKUP_PRIORS = ((0.5, 0.8), (0.3, 0.65), (0.5, 0.7), (0.55, 0.7), (0.9, 0.87), (0.95, 0.97))
    LONG_MATCH = 8

    def __init__(self, prior_weight: float = 4.0) -> None:
        lows = (0.0,) + SCORE_EDGES[:-1]
        centres = [(lo + min(hi, 1.0)) / 2 for lo, hi in zip(lows, SCORE_EDGES)]
        self.draft = [[0.8 * c * prior_weight, prior_weight] for c in centres]  # [accepted, offered] per bin
        # [matched suffix length bucket (`_bucket`)][depth - 1] -> [accepted, offered]
        self.lookup = [[[p * r ** d * prior_weight, prior_weight] for d in range(MAX_LOOKUP_DEPTH)]
                       for p, r in self.LOOKUP_PRIORS]
        self.branch = [[0.15 * 0.7 ** d * prior_weight, prior_weight] for d in range(MAX_LOOKUP_DEPTH)]

    @staticmethod
    def _bin(score: float) -> int:
        return min(bisect.bisect_right(SCORE_EDGES, score), len(SCORE_EDGES) - 1)

    @classmethod
    def _bucket(cls, ngram: int) -> int:
        """0-4 by matched suffix length (4: up to LONG_MATCH - 1 tokens), then one bucket for long matches."""
        long = len(cls.LOOKUP_PRIORS) - 1
        return long if ngram >= cls.LONG_MATCH else min(max(ngram, 0), long - 1)

    def _lookup_cell(self, exit_layer: int, depth: int, ngram: int = 0) -> list[float]:
        d = min(depth, MAX_LOOKUP_DEPTH) - 1
        if exit_layer != LOOKUP:
            return self.branch[d]
        return self.lookup[self._bucket(ngram)][d]

    def _lookup_p(self, exit_layer: int, depth: int, ngram: int = 0) -> float:
        acc, off = self._lookup_cell(exit_layer, depth, ngram)
        return acc / off

    def estimate(self, tree: TokenTree) -> list[float]:
        depths = tree.depths()
        est = []
        for ex, score, d in zip(tree.exits, tree.scores, depths):
            a, o = self.draft[self._bin(score)]
            p = a / o if score > 0 else 0.0
            if is_lookup(ex):
                p = max(p, self._lookup_p(ex, d, tree.match_ngram))
            est.append(p)
        # A node is never likelier than its parent (the path must be accepted first).
        for i, par in enumerate(tree.parents):
            if par >= 0:
                est[i] = min(est[i], est[par])
        return est

    def score_for(self, p: float) -> float:
        """The lowest draft path probability whose bin is accepted with probability >= p (1.01: none is)."""
        lows = (0.0,) + SCORE_EDGES[:-1]
        for lo, (acc, off) in zip(lows, self.draft):
            if acc / off >= p:
                return lo
        return SCORE_EDGES[-1]

    def observe(self, tree: TokenTree, path: list[int]) -> None:
        on_path = set(path)
        for i, (ex, score, d) in enumerate(zip(tree.exits, tree.scores, tree.depths())):
            hit = float(i in on_path)
            if score > 0:
                cell = self.draft[self._bin(score)]
                cell[0] += hit
                cell[1] += 1
            if is_lookup(ex):
                cell = self._lookup_cell(ex, d, tree.match_ngram)
                cell[0] += hit
                cell[1] += 1
