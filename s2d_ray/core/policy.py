"""Draft-length policies: how many tokens to draft next round, from what the last round accepted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class DraftLengthPolicy(Protocol):
    def initial(self) -> int: ...

    def update(self, n_accepted: int, k: int) -> int:
        """Next k after a round that drafted k tokens and accepted n_accepted of them."""
        ...


@dataclass(frozen=True)
class FixedK:
    k: int

    def initial(self) -> int:
        return self.k

    def update(self, n_accepted: int, k: int) -> int:
        return self.k


@dataclass(frozen=True)
class HeuristicK:
    """+2 after a fully accepted round, -1 otherwise, never below `min_k` (S2D and transformers' rule)."""

    start: int = 5
    min_k: int = 1
    max_k: int = 16

    def initial(self) -> int:
        return self.start

    def update(self, n_accepted: int, k: int) -> int:
        nxt = k + 2 if n_accepted == k else k - 1
        return max(self.min_k, min(self.max_k, nxt))
