"""Row bookkeeping over a slot cache: which cache row each sequence holds, how many positions of it hold KV per
segment, and how forwards over many rows are planned.

`RowTable` maps sequence ids to cache rows and keeps, per segment, how many positions hold KV; syncing a row with the
token prefix a caller sends cuts those counts back to the common prefix, which is the whole KV rollback. Finished
rows may be kept for later prompts (prefix_cache.py) and forked into new sequences.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .cache import SlotKVCache
from .errors import CapacityError
from .prefix_cache import PrefixCacheSpec, RetiredRows

logger = logging.getLogger(__name__)


@dataclass
class PendingTree:
    """KV of a verified token tree: node i sits at slot `start + i`, not yet at the slot of its depth."""

    start: int
    tokens: list[int]
    parents: list[int]

    def path(self, tokens: list[int]) -> list[int]:
        """Nodes along `tokens[start:]` from the root down (the accepted path, as the caller's tokens now say)."""
        out, node = [], -1
        for tok in tokens[self.start:]:
            nxt = next((i for i, (p, t) in enumerate(zip(self.parents, self.tokens)) if p == node and t == tok), None)
            if nxt is None:
                break
            out.append(nxt)
            node = nxt
        return out


def cache_scope(seq_id: str) -> str:
    """The cache scope a seq id names: `<scope>:<id>` forks only from rows of the same scope (the server puts the
    tenant and its `cache_salt` there, so one tenant's prompts never seed another's KV); an id without ':' is in the
    shared scope ""."""
    return seq_id.rpartition(":")[0]


@dataclass
class RowState:
    """One sequence's place in a cache: its row, the tokens it was synced to, KV fill per segment, its scope."""

    row: int
    tokens: list[int] = field(default_factory=list)
    filled: list[int] = field(default_factory=list)  # per segment: positions [0, filled) hold KV
    tree: PendingTree | None = None  # the last verified tree, compacted on the next sync
    scope: str = ""  # cache_scope of its seq id: forks read only rows of the same scope
    adapter: str = ""  # whose weights computed this row's KV (core/lora.py's key; "" the base): forks stay within it

    def held_prefix(self, tokens: list[int]) -> int:
        """How many leading positions of `tokens` this row holds KV for (first segment)."""
        return min(self.filled[0], common_prefix(self.tokens, tokens)) if self.filled else 0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] holds, a[:hi] == b[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class RowTable:
    """seq_id -> RowState with a free list; sync() is the KV rollback (cut fill back to the common token prefix).

    With `max_rows` set (set_limits) the table never holds more sequences than that: a new sequence takes the row of
    the least recently synced one (a sequence that finished elsewhere, moved to another replica, or idles). The
    evicted sequence loses only time: its next call finds no state and recomputes from its token prefix.
    """

    def __init__(self, num_segments: int, cache: SlotKVCache) -> None:
        self.num_segments = num_segments
        self.cache = cache
        self.states: OrderedDict[str, RowState] = OrderedDict()  # least recently synced first
        self.max_rows: int | None = None
        self.num_evicted = 0  # sequences whose row was taken for another (their KV is recomputed if they return)
        self.num_forked_tokens = 0  # prompt positions copied from another row instead of computed (fork)
        self.prefix_cache: RetiredRows | None = None  # finished rows kept for forks (use_prefix_cache)
        self.forked_stores: list = []  # per-row stores a fork copies with the KV (a drafter's HiddenStore)
        self._free: list[int] = []
        self._next_row = 0

    def set_limits(self, max_rows: int | None, max_slots: int | None = None) -> None:
        """Bound this table's rows and its cache's growth (call before use; memory <= max_rows x max_slots)."""
        self.max_rows = max_rows
        self.cache.max_rows, self.cache.max_slots = max_rows, max_slots

    def use_prefix_cache(self, spec: PrefixCacheSpec | None) -> None:
        """Keep finished sequences' rows for later forks, up to spec.max_tokens positions (None: clear on release)."""
        self.prefix_cache = RetiredRows(spec) if spec is not None else None

    def sync_batch(self, items: list[tuple[str, list[int]]]) -> list[RowState]:
        """sync() every (seq_id, tokens) of one forward; none of them can evict another. More distinct sequences than
        max_rows in one forward is refused (CapacityError) before any state changes: callers split such batches."""
        distinct = {seq_id for seq_id, _ in items}
        if self.max_rows is not None and len(distinct) > self.max_rows:
            raise CapacityError(f"{len(distinct)} sequences in one forward; this replica holds at most "
                                f"{self.max_rows} (split the batch or raise max_live_sequences)")
        for seq_id in distinct & self.states.keys():
            self.states.move_to_end(seq_id)  # protect the batch's own rows from eviction below
        return [self.sync(seq_id, tokens) for seq_id, tokens in items]

    def sync(self, seq_id: str, tokens: list[int]) -> RowState:
        state = self.states.get(seq_id)
        if state is None:
            state = RowState(row=self._take_row(), filled=[0] * self.num_segments, scope=cache_scope(seq_id))
            self.states[seq_id] = state
        else:
            self.states.move_to_end(seq_id)
            if state.tree is not None:
                self._commit_tree(state, tokens)
            keep = common_prefix(state.tokens, tokens)
            if keep < min(state.filled, default=0):
                logger.debug("seq %s: prefix mismatch at %d, recomputing from there", seq_id, keep)
            state.filled = [min(f, keep) for f in state.filled]
        state.tokens = list(tokens)
        return state

    def _commit_tree(self, state: RowState, tokens: list[int]) -> None:
        """Keep only the accepted path of the last tree: move its KV to consecutive slots after the prefix (one
        gather per layer); rejected nodes are left behind to be overwritten. Afterwards rollback is a length again."""
        tree, state.tree = state.tree, None
        path = tree.path(tokens)
        if not path:
            return
        src = [tree.start + i for i in path]
        if src != list(range(tree.start, tree.start + len(path))):
            self.cache.move_slots(state.row, src, tree.start)
        state.tokens = state.tokens[: tree.start] + [tree.tokens[i] for i in path]
        state.filled = [tree.start + len(path) if f >= tree.start else f for f in state.filled]

    def holders(self) -> list[RowState]:
        """The rows holding KV: where `fork` looks (taken once for a batch of forks, not once per fork: a forked row
        holds a prefix of its source, never more). Finished rows the prefix cache keeps come first."""
        kept = self.prefix_cache.states() if self.prefix_cache is not None else []
        return kept + [state for state in self.states.values() if state.filled and state.filled[0] > 0]

    def fork(self, seq_id: str, limit: int, among: list[RowState] | None = None) -> int:
        """Give a sequence with no KV yet the longest prefix of its tokens that another live row of its scope holds
        (of `among`, default every row), at most `limit` positions: one copy per layer instead of a prefill (n choices
        of one prompt, a shared system prompt). Returns the positions it now holds (0: nothing shared)."""
        state = self.states[seq_id]
        if any(state.filled):
            return 0
        src, shared = None, 0
        for other in self.states.values() if among is None else among:  # fewer positions than found cannot do better
            if other is state or not other.filled or other.filled[0] <= shared or other.scope != state.scope:
                continue
            n = min(other.held_prefix(state.tokens), limit)
            if n > shared:
                src, shared = other, n
                if shared >= limit:  # n choices of one prompt: the first row that holds it ends the search
                    break
        if src is None:
            return 0
        for store in [self.cache, *self.forked_stores]:
            store.copy_prefix(src.row, state.row, shared)
        if self.prefix_cache is not None:
            self.prefix_cache.touch(src)
        state.filled = [min(f, shared) for f in src.filled]
        self.num_forked_tokens += state.filled[0]
        return state.filled[0]

    def fork_counted(self, seq_id: str, limit: int, among: list[RowState]) -> int:
        """`fork` for a new sequence, counted in the prefix cache's queries (`limit` positions) and hits."""
        forked = self.fork(seq_id, limit, among=among) if among else 0
        if self.prefix_cache is not None:
            self.prefix_cache.queries += max(limit, 0)
            self.prefix_cache.hits += forked
        return forked

    def cached_prefix(self, seq_id: str, tokens: list[int]) -> int:
        """How many leading positions of `tokens` already hold KV here in the first segment (0 for an unknown id)."""
        state = self.states.get(seq_id)
        return 0 if state is None else state.held_prefix(tokens)

    def _take_row(self) -> int:
        if self._free:
            return self._free.pop()
        if self.max_rows is None or self._next_row < self.max_rows:
            self._next_row += 1
            return self._next_row - 1
        kept = self.prefix_cache.take() if self.prefix_cache is not None else None
        if kept is not None:  # a finished sequence's cached prefix gives way before a live sequence does
            return kept
        seq_id, state = next(iter(self.states.items()))  # least recently synced
        logger.debug("row %d: evicting seq %s (table full at %d rows)", state.row, seq_id, self.max_rows)
        del self.states[seq_id]
        self.num_evicted += 1
        return state.row  # stale KV in it is never read: the new sequence's fill starts at 0

    def release(self, seq_id: str) -> None:
        state = self.states.pop(seq_id, None)
        if state is None:
            return
        freed = [state.row] if self.prefix_cache is None else self.prefix_cache.retire(state, self.cache.num_slots)
        for row in freed:
            self.cache.clear_row(row)
            self._free.append(row)

    def __len__(self) -> int:
        return len(self.states)


def limit_rows(holder, max_rows: int | None, max_slots: int | None = None) -> None:
    """Bound a drafter's or verifier's per-sequence memory: its RowTable and cache, and a drafter's HiddenStore."""
    holder.table.set_limits(max_rows, max_slots)
    hidden = getattr(holder, "hidden", None)
    if hidden is not None:
        hidden.max_rows, hidden.max_slots = max_rows, max_slots


# Positions per pass over a long prompt (verifier and draft): attention over n positions at once builds [heads, n, n]
# scores that fall out of cache, so a long prompt runs faster in passes of a few hundred positions.
PREFILL_CHUNK = 256
FREE_WIDTH = 32  # padding a row by this many positions costs about what one more forward's fixed overhead does


def length_groups(counts: list[int], free_width: int = FREE_WIDTH) -> list[list[int]]:
    """Split rows with `counts` pending positions into forwards that waste little on padding.

    A forward pads every row to its longest, so one 1000-token prompt batched with seven decode rows would compute
    8000 positions instead of about 1000: that made served throughput FALL with concurrency. Rows are taken longest
    first and a row joins the current forward while padding it costs at most `free_width` positions, so decode rows
    (chains, trees) share one forward and each prompt of another length gets its own. Returns row indices per
    forward, each list in the rows' original order.
    """
    order = sorted(range(len(counts)), key=lambda i: -counts[i])
    groups: list[list[int]] = []
    width = 0
    for i in order:
        if groups and width - counts[i] <= free_width:
            groups[-1].append(i)
        else:
            groups.append([i])
            width = counts[i]
    return [sorted(g) for g in groups]


def pending_grid(starts: list[int], ends: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions start..end (inclusive) per row, padded on the right past `end` with dummy positions.

    Returns positions: [n, s] and valid: [n, s]. Dummy positions write only to slots after the row's last token,
    which are rewritten before any real query can attend to them.
    """
    counts = [e - s + 1 for s, e in zip(starts, ends)]
    width = max(counts)
    offs = torch.arange(width, device=device)
    start_t = torch.tensor(starts, device=device)[:, None]
    count_t = torch.tensor(counts, device=device)[:, None]
    return start_t + offs, offs < count_t
