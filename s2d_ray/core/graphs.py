"""CUDA graphs of a layer segment's forward, by shape bucket: what makes a GPU decode step cost its kernels, not Python.

An eager decode round of a large model on a GPU launches about a thousand small kernels, and the host time spent
launching them is several times the GPU's work (see BENCHMARKS.md, GPU rounds). A captured graph replays all of a
segment's kernels in one launch.

A graph needs fixed shapes and fixed tensors. So a segment call of n rows x w positions over a cache is padded to a
bucket (B rows, W positions, S attended slots) and its inputs are copied into that bucket's static buffers:
- pad positions of a real row continue after its last position, and pad rows reuse the last real row at the last W
  slots of the bucket: both write K/V only to slots after every real token (stale slots, rewritten before any query
  sees them, the slot cache's rule), and both see a causal mask, so their values stay finite;
- attention runs over S slots with the causal (or tree) mask of the real rows: masked slots add exactly zero.
The same padded forward runs eagerly where nothing can be captured (the CPU), which is how CI tests its exactness;
capture and replay themselves run on CUDA only (tests/unit/test_graphs.py, scripts/gpu_check.sh).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .cache import SlotKVCache, additive_mask, causal_allowed

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 32)
WIDTH_BUCKETS = (1, 2, 4, 8, 16, 32)
SLOT_BUCKETS = tuple(256 * 2**i for i in range(6))  # 256 .. 8192


def bucket(n: int, sizes: tuple[int, ...]) -> int | None:
    return next((s for s in sizes if s >= n), None)


@dataclass
class _Bucket:
    """Static inputs and output of one (segment, B, W, S) shape, and its captured graph (None: runs eagerly)."""

    x: torch.Tensor
    rows: torch.Tensor
    positions: torch.Tensor
    rope: torch.Tensor
    mask: torch.Tensor
    out: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


class SegmentGraphs:
    """Padded, bucketed forwards of one LayerStack's segments; captured as CUDA graphs when `capture` is set.

    Buckets are built on first use. A cache that grows (new tensors) drops the captured graphs of its shapes: they
    point at the old tensors. Calls wider than the largest bucket (long prefills) return None and run eagerly.
    """

    def __init__(self, stack, capture: bool) -> None:
        self.stack = stack
        self.capture = capture
        self.buckets: dict[tuple, _Bucket] = {}
        self.pool = None
        self.failed = False  # a capture failed once: run eagerly from then on (logged)
        self.replays = 0

    def fits(self, n: int, w: int, kv_len: int) -> tuple[int, int, int] | None:
        b, wb = bucket(n, ROW_BUCKETS), bucket(w, WIDTH_BUCKETS)
        if b is None or wb is None:
            return None
        s = bucket(kv_len + wb, SLOT_BUCKETS)  # room for the pad rows' W slots after every real position
        return None if s is None else (b, wb, s)

    @torch.no_grad()
    def run(self, seg: int, x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, cache: SlotKVCache,
            rope: torch.Tensor | None, allowed: torch.Tensor | None) -> torch.Tensor | None:
        """hidden [n, w, h] of the segment, or None when no bucket fits (the caller runs it eagerly)."""
        if self.failed:
            return None
        n, w = positions.shape
        kv_len = int(positions.max()) + 1
        shape = self.fits(n, w, kv_len)
        if shape is None:
            return None
        b, wb, s = shape
        if cache.max_slots is not None and s > cache.max_slots:  # a bounded cache: the bucket would not fit
            return None
        cache.reserve(int(rows.max()) + 1, s)
        key = (seg, id(cache), cache.keys[0].data_ptr(), b, wb, s)
        slot = self.buckets.get(key)
        if slot is None:
            stale = [k for k in self.buckets if k[1] == id(cache) and k[2] != key[2]]
            for k in stale:  # the cache grew: graphs of its old tensors are dead
                del self.buckets[k]
            slot = self._new_bucket(x, b, wb, s)
        self._fill(slot, x, rows, positions, rope, allowed, n, w, s)
        if slot.graph is None and self.capture and not self.failed:
            self._capture(seg, slot, cache, s)
        if slot.graph is not None:
            slot.graph.replay()
            self.replays += 1
        else:
            slot.out = self._forward(seg, slot, cache, s)
        self.buckets[key] = slot
        return slot.out[:n, :w].clone()

    def _new_bucket(self, x: torch.Tensor, b: int, wb: int, s: int) -> _Bucket:
        dev = x.device
        long = dict(dtype=torch.long, device=dev)
        return _Bucket(x=torch.zeros(b, wb, x.shape[-1], dtype=x.dtype, device=dev), rows=torch.zeros(b, **long),
                       positions=torch.zeros(b, wb, **long), rope=torch.zeros(b, wb, **long),
                       mask=torch.zeros(b, 1, wb, s, dtype=x.dtype, device=dev))

    def _fill(self, slot: _Bucket, x, rows, positions, rope, allowed, n: int, w: int, s: int) -> None:
        """Copy a call into the bucket's static inputs (device ops only: no host sync)."""
        b, wb = slot.positions.shape
        slot.x.zero_()
        slot.x[:n, :w] = x
        slot.rows[:n] = rows
        slot.rows[n:] = rows[-1]
        steps = torch.arange(1, wb - w + 1, device=positions.device)
        slot.positions[:n, :w] = positions
        slot.positions[:n, w:] = positions[:, -1:] + steps  # after the row's last position: stale slots
        slot.positions[n:] = torch.arange(s - wb, s, device=positions.device)  # the last W slots of the bucket
        slot.rope.copy_(slot.positions)
        if rope is not None:
            slot.rope[:n, :w] = rope
        grid = causal_allowed(slot.positions, s)
        if allowed is not None:
            grid[:n, :w, : allowed.shape[-1]] = allowed
        slot.mask.copy_(additive_mask(grid, slot.mask.dtype))

    def _forward(self, seg: int, slot: _Bucket, cache: SlotKVCache, s: int) -> torch.Tensor:
        """The segment's layers over the static inputs (what a graph captures)."""
        cache.point(slot.rows, slot.positions, s)  # rows vary from replay to replay: always gathered
        return self.stack.run_layers(seg, slot.x, slot.mask, slot.rope, cache)

    def _capture(self, seg: int, slot: _Bucket, cache: SlotKVCache, s: int) -> None:
        """Warm up on a side stream (as CUDA graphs require), then capture. The warm-up writes the same K/V the
        replay will: writes are idempotent. A failure turns graphs off for this stack, logged once."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        try:
            # Memory-efficient attention takes any additive mask and is capturable (float64 falls back to math).
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._forward(seg, slot, cache, s)
                torch.cuda.current_stream().wait_stream(side)
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    slot.out = self._forward(seg, slot, cache, s)
            slot.graph = graph
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager, loudly
            self.failed = True
            slot.graph = None
            logger.warning("CUDA graph capture failed (%s: %s): this stack runs eagerly", type(exc).__name__, exc)
