"""A slot KV cache: one row per sequence, one slot per token position, per layer.

Positions index slots directly, so sequences of different lengths share one tensor without left padding, a draft's
layers may be filled to different depths (lazy KV fill), and rolling back after verification is only lowering a
length: stale slots are overwritten before any query can see them (gpt-fast's rule).
"""

from __future__ import annotations

import torch


def grown(current: int, needed: int, cap: int | None = None) -> int:
    """A dimension's new size: unchanged when it already holds `needed`, else doubled (amortised growth) but never
    past `cap` (a configured bound), and never below `needed`."""
    if needed <= current:
        return current
    doubled = 2 * current if cap is None else min(2 * current, cap)
    return max(needed, doubled)


# Runs of consecutive rows a pass may attend over in place of a gather (each run is a few more small ops a layer).
MAX_RUNS = 4


class SlotKVCache:
    """Keys and values as [rows, slots, kv_heads, head_dim] per layer; grows rows and slots on demand.

    Rows and slots grow independently (each doubles only when that dimension is short), up to `max_rows` and
    `max_slots` when set, so memory is bounded by max_rows x max_slots x per-token KV bytes.

    Duck-types the one method transformers attention layers call (`update`), so Hugging Face decoder layers of any
    Llama-like family write into it. Call `select(rows, positions, kv_len)` before running layers.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        rows: int = 1,
        slots: int = 128,
    ) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        # Zeros, never torch.empty: a masked slot still enters q.k, and NaN garbage there would poison softmax.
        self.keys = [self._zeros(rows, slots) for _ in range(num_layers)]
        self.values = [self._zeros(rows, slots) for _ in range(num_layers)]
        self._rows: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._kv_len = 0
        self._span: tuple[int, int] | None = None
        self._slots: tuple[int, int, int] | None = None  # (row, first, end): one row's consecutive new slots
        self.max_rows: int | None = None  # growth caps (None: unbounded); see RowTable.set_limits
        self.max_slots: int | None = None
        # Passes whose rows were not one in-order range, so every layer gathered their K/V (a copy): what a batch of
        # rows that do not sit side by side costs (the served stats show it).
        self.num_passes = self.num_gathered = 0

    def _zeros(self, rows: int, slots: int) -> torch.Tensor:
        return torch.zeros(rows, slots, self.num_kv_heads, self.head_dim, dtype=self.dtype, device=self.device)

    @property
    def num_rows(self) -> int:
        return self.keys[0].shape[0]

    @property
    def num_slots(self) -> int:
        return self.keys[0].shape[1]

    def reserve(self, rows: int, slots: int) -> None:
        """Grow to at least `rows` x `slots`; each dimension doubles only when it is the short one."""
        add_rows = grown(self.num_rows, rows, self.max_rows) - self.num_rows
        add_slots = grown(self.num_slots, slots, self.max_slots) - self.num_slots
        if not add_rows and not add_slots:
            return
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                if add_slots:
                    t = torch.cat([t, self._zeros(t.shape[0], add_slots)], dim=1)
                if add_rows:
                    t = torch.cat([t, self._zeros(add_rows, t.shape[1])], dim=0)
                store[i] = t

    def select(self, rows: torch.Tensor, positions: torch.Tensor, kv_len: int,
               runs_ok: bool = False) -> list[tuple[int, int, int, int]] | None:
        """Set which rows and positions the next layer calls write, and how many slots they attend over.

        rows: [n] row indices; positions: [n, s] slot of each new token; kv_len: slots visible to attention.
        runs_ok: the caller's attention can take K/V over the rows' covering range with `runs` (below); then rows
        in ascending order with a few holes are not gathered. Returns those runs, or None (a view or a gather).
        """
        first = int(rows.min())
        self.reserve(int(rows.max()) + 1, max(kv_len, int(positions.max()) + 1))
        # Rows first..first+n-1 in order (callers sort their batch by row): attention reads a view of the cache.
        # Any other set is gathered, a copy of every layer's K/V per call (a large share of a many-row round over
        # mixed contexts on the CPU), unless the attention reads the covering range's view run by run: served passes
        # skip rows often (a plain call's later steps run the rows still stepping; a prompt round's decode rows skip
        # the row being prefilled), so gathering made served forwards several times dearer than in-process ones.
        span = torch.arange(first, first + rows.numel(), device=rows.device)
        in_order = bool((rows == span).all())
        self.num_passes += 1
        runs = self._runs(rows) if runs_ok and not in_order else None
        self.num_gathered += not in_order and runs is None
        if runs is not None:
            self.point(rows, positions, kv_len, (first, int(rows.max()) + 1))
        else:
            self.point(rows, positions, kv_len, (first, first + rows.numel()) if in_order else None)
        self._slots = self._one_run(rows, positions)
        return runs

    @staticmethod
    def _one_run(rows: torch.Tensor, positions: torch.Tensor) -> tuple[int, int, int] | None:
        """(row, first slot, end slot) when one row writes consecutive slots (a decode step, a chain, a prompt):
        then `update` copies into a slice instead of scattering through index_put, a few microseconds a layer that
        add up over a decode step's layers."""
        if rows.numel() != 1:
            return None
        p = positions[0]
        first, end = int(p[0]), int(p[-1]) + 1
        if end - first != p.numel() or (p.numel() > 1 and not bool((p[1:] > p[:-1]).all())):
            return None
        return int(rows[0]), first, end

    @staticmethod
    def _runs(rows: torch.Tensor) -> list[tuple[int, int, int, int]] | None:
        """Rows in ascending order as at most MAX_RUNS runs of consecutive rows: (first query, end query, first key
        row, end key row), key rows counted from the first row; None when they are not ascending or too many."""
        r = rows.tolist()
        if any(b <= a for a, b in zip(r, r[1:])):
            return None
        cuts = [0] + [i for i in range(1, len(r)) if r[i] != r[i - 1] + 1] + [len(r)]
        if len(cuts) - 1 > MAX_RUNS:
            return None
        return [(a, b, r[a] - r[0], r[b - 1] - r[0] + 1) for a, b in zip(cuts, cuts[1:])]

    def point(self, rows: torch.Tensor, positions: torch.Tensor, kv_len: int,
              span: tuple[int, int] | None = None) -> None:
        """`select` without its checks and growth (no host sync): for callers that reserved the slots themselves
        (CUDA graphs, whose rows change between replays, so they pass no span and always gather)."""
        self._rows, self._positions, self._kv_len, self._span = rows, positions, kv_len, span
        self._slots = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write new k/v ([n, kv_heads, s, head_dim]) at the selected slots; return k/v over the first kv_len slots."""
        rows, pos = self._rows, self._positions
        k_store, v_store = self.keys[layer_idx], self.values[layer_idx]
        if self._slots is not None:
            row, first, end = self._slots
            k_store[row, first:end] = key_states[0].transpose(0, 1)
            v_store[row, first:end] = value_states[0].transpose(0, 1)
        else:
            k_store[rows[:, None], pos] = key_states.transpose(1, 2).to(self.dtype)
            v_store[rows[:, None], pos] = value_states.transpose(1, 2).to(self.dtype)
        if self._span is not None:
            lo, hi = self._span
            k, v = k_store[lo:hi, : self._kv_len], v_store[lo:hi, : self._kv_len]
        else:
            k, v = k_store[rows, : self._kv_len], v_store[rows, : self._kv_len]
        return k.transpose(1, 2), v.transpose(1, 2)

    @torch.no_grad()
    def move_slots(self, row: int, src: list[int], dst_start: int) -> None:
        """Copy K/V of slots `src` (in order) to consecutive slots from `dst_start`, in every layer."""
        src_t = torch.tensor(src, device=self.device)
        dst = slice(dst_start, dst_start + len(src))
        for store in (self.keys, self.values):
            for t in store:
                t[row, dst] = t[row, src_t]  # advanced indexing gathers a copy first: overlaps are safe

    @torch.no_grad()
    def copy_prefix(self, src_row: int, dst_row: int, num_slots: int) -> None:
        """Copy K/V of slots [0, num_slots) from one row to another, in every layer (a forked sequence's prompt)."""
        self.reserve(max(src_row, dst_row) + 1, num_slots)
        for store in (self.keys, self.values):
            for t in store:
                t[dst_row, :num_slots] = t[src_row, :num_slots]

    def nbytes(self) -> int:
        """Bytes held by keys and values (replica stats check them against the configured bound)."""
        return sum(t.numel() * t.element_size() for store in (self.keys, self.values) for t in store)

    @torch.no_grad()
    def clear_row(self, row: int) -> None:
        """Zero a freed row so no state of a finished request outlives it."""
        for store in (self.keys, self.values):
            for t in store:
                t[row].zero_()


class HiddenStore:
    """Hidden states at each inner exit, [rows, slots, h], kept for lazily filling deeper layers later.

    Rows and slots grow independently (amortised doubling of the short dimension only), capped like the KV cache
    (`max_rows`, `max_slots`), so this store's size is bounded by max_rows x max_slots x hidden x inner exits.
    """

    def __init__(self, num: int, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        self.bufs = [torch.zeros(1, 16, hidden, dtype=dtype, device=device) for _ in range(num)]
        self.max_rows: int | None = None
        self.max_slots: int | None = None

    def reserve(self, rows: int, slots: int) -> None:
        for i, b in enumerate(self.bufs):
            new_rows, new_slots = grown(b.shape[0], rows, self.max_rows), grown(b.shape[1], slots, self.max_slots)
            if (new_rows, new_slots) != tuple(b.shape[:2]):
                nb = b.new_zeros(new_rows, new_slots, b.shape[2])
                nb[: b.shape[0], : b.shape[1]] = b
                self.bufs[i] = nb

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.bufs)

    @torch.no_grad()
    def copy_prefix(self, src_row: int, dst_row: int, num_slots: int) -> None:
        """Copy the kept states of slots [0, num_slots) from one row to another (a forked sequence's prompt)."""
        self.reserve(max(src_row, dst_row) + 1, num_slots)
        for b in self.bufs:
            b[dst_row, :num_slots] = b[src_row, :num_slots]

    @torch.no_grad()
    def move_slots(self, row: int, src: list[int], dst_start: int) -> None:
        """Copy the kept states of slots `src` (in order) to consecutive slots from `dst_start` (a tree's path)."""
        self.reserve(row + 1, max(src) + 1)  # a leaf of the path was never forwarded: its slot may lie past the end
        for b in self.bufs:
            b[row, dst_start : dst_start + len(src)] = b[row, torch.tensor(src, device=b.device)]


def causal_allowed(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[n, s, kv_len] bool: a token at slot p sees slots 0..p of its own row."""
    slots = torch.arange(kv_len, device=positions.device)
    return slots[None, None, :] <= positions[:, :, None]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, s, kv_len] bool -> additive attention mask [n, 1, s, kv_len]."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def slot_mask(positions: torch.Tensor, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask [n, 1, s, kv_len]: a token at position p sees slots 0..p of its own row."""
    return additive_mask(causal_allowed(positions, kv_len), dtype)


def head_mask(mask: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[n, 1, s, kv] -> [n, heads, s, kv] as SDPA takes it fastest on the mask's device.

    CPU SDPA is many times slower with a head-broadcast mask, so there each head gets its own materialised
    copy; CUDA kernels read the broadcast view (stride 0 over heads) at no cost, and a copy would only spend memory
    bandwidth (heads x s x kv elements per layer call)."""
    view = mask.expand(-1, num_heads, -1, -1)
    return view if mask.device.type == "cuda" else view.contiguous()
