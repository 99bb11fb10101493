"""Prefix cache: the KV rows of finished sequences, kept (least recently used first) until their memory is needed.

A finished sequence's row is retired here instead of cleared, so a later sequence whose tokens start the same way
(a system prompt, the previous turn of a chat, a retried request) forks that prefix (one copy per layer, as the n
choices of one prompt do) and prefills only the rest.

Why rows and not a radix tree or block hashes: the slot cache keeps a sequence's KV in one row, slot = position, so a
prefix is reused by copying a slot range from ONE source row. A lookup compares the new tokens with each held row's
own token list (common_prefix), which is exact by construction: a row is used only for the positions whose token ids
equal the new sequence's, with no hash that could collide. The rows held are few (each holds at least
`min_tokens` positions and all of them at most `max_tokens`), so a scan costs little next to one forward.

Rows are scoped (RowState.scope, from the seq id: rows.cache_scope): a fork reads only rows of its own scope, so
the server's tenants never share KV, never see each other's hits in their timing, and never evict each other's
entries as redundant (they do share the token budget, least recently used first).

The cache lives inside one verifier or drafter, which is built for one model: a prefix never outlives the weights
that computed it. A verifier serving LoRA adapters keys each row by its adapter's registration (RowState.adapter), and
rows of different adapters never stand for each other.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixCacheSpec:
    """How many token positions of finished sequences a cache keeps; rows shorter than `min_tokens` are not worth a
    fork (computing them costs about what one copy does) and would only hold rows."""

    max_tokens: int
    min_tokens: int = 32

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"prefix cache max_tokens must be >= 1, got {self.max_tokens}")


class RetiredRows:
    """Retired RowStates by key, least recently used first, with the positions they hold summed under a bound.

    `retire` may return rows to free (the entries that no longer fit); `take` gives up the least recently used row
    when the table needs one. Counters follow vLLM's: `queries` and `hits` in prompt tokens.
    """

    def __init__(self, spec: PrefixCacheSpec) -> None:
        self.spec = spec
        self.entries: OrderedDict[int, object] = OrderedDict()  # key -> RowState (rows.py; typed loosely: no cycle)
        self.num_tokens = 0
        self.queries = self.hits = 0
        self._next_key = 0

    def retire(self, state, row_slots: int) -> list[int]:
        """Keep `state`'s row; return rows to free (the state itself when too short, or evicted older entries).

        A row takes `row_slots` slots of memory however few positions it holds, so the rows kept are bounded too:
        at most max_tokens // row_slots (at least one), and the memory kept stays within max_tokens slots."""
        held = state.filled[0] if state.filled else 0
        if held < self.spec.min_tokens or held > self.spec.max_tokens:
            return [state.row]
        freed = [self._drop(key) for key, old in list(self.entries.items()) if _covers(state, old)]
        self.entries[self._next_key] = state
        self._next_key += 1
        self.num_tokens += held
        max_rows = max(1, self.spec.max_tokens // max(row_slots, 1))
        while self.num_tokens > self.spec.max_tokens or len(self.entries) > max_rows:
            freed.append(self._drop(next(iter(self.entries))))
        return freed

    def touch(self, state) -> None:
        """A fork read this entry: it becomes the most recently used."""
        for key, held in self.entries.items():
            if held is state:
                self.entries.move_to_end(key)
                return

    def take(self) -> int | None:
        """The least recently used row, removed from the cache (None when empty)."""
        return self._drop(next(iter(self.entries))) if self.entries else None

    def stats(self) -> dict:
        """vLLM's counters (`prefix_cache_queries`, `prefix_cache_hits`: tokens) and the positions held now."""
        return {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits,
                "prefix_cache_tokens": self.num_tokens, "prefix_cache_max_tokens": self.spec.max_tokens}

    def states(self) -> list:
        return list(self.entries.values())

    def _drop(self, key: int) -> int:
        state = self.entries.pop(key)
        self.num_tokens -= state.filled[0]
        return state.row

    def __len__(self) -> int:
        return len(self.entries)


def _covers(new, old) -> bool:
    """`new` holds every position `old` holds (the same chat, one turn later) in the same scope: `old` is redundant."""
    n = old.filled[0]
    return (new.scope == old.scope and new.adapter == old.adapter and new.filled[0] >= n
            and new.tokens[:n] == old.tokens[:n])
