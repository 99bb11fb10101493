"""Roofline costs of forwards and rounds, and the throughput of a replica with or without speculation.

A forward over B rows x n positions at context c on a device costs
    max(bytes / (bandwidth x eff), flops / (peak x eff)) + layers x layer_overhead + forward + (B - 1) x row overheads
with bytes = weights read once + every row's KV, flops = 2 x weights x tokens + attention. On a device whose
compute does not overlap the weight stream (one CPU core), the two terms add instead: bytes / bandwidth covers one
token per row, and every further token adds its FLOPs at the marginal rate. A round costs the
target forward plus, with speculation, k draft depths (each one draft forward over B rows x 1 position), plus the
engine's round overhead; it emits B x MAT tokens, where MAT(k) = (1 - a^(k+1)) / (1 - a) for a per-token
agreement a (accepted drafts are a run of agreements, plus the target's own bonus token).

A stream's wall time per round adds, to the round, the price of the round's deployment calls crossing from the
router's node to the draft's and the target's (`cross_node_ms` per call): latency, not GPU time, since a replica
verifies other routers' rounds while one call is in transit.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Device
from .shapes import ModelShape

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
# The extra wall time of one deployment call whose replica is on another node than the router, against the same
# call on the router's node: `s2d bench cross-node` (three raylets over loopback, so a floor for a real network;
# BENCHMARKS.md, "Cross-node rounds": no measurable extra over loopback). `s2d plan --cross-node-ms` sets a
# real network's round trip.
CROSS_NODE_MS = 0.0


def forward_ms(shape: ModelShape, dev: Device, rows: int, positions: int, context: int, dtype_bytes: int = 2,
               layers: int | None = None) -> float:
    """One forward of `shape` (per TP rank) through `layers` layers and its head, on `dev`."""
    n = shape.layers if layers is None else layers
    nbytes = shape.weight_bytes(dtype_bytes, n) + rows * context * shape.kv_bytes_per_token(dtype_bytes, n)
    flops = shape.forward_flops(rows, positions, context, n)
    memory_ms = 1e3 * nbytes / (dev.bandwidth_gbs * 1e9 * dev.bandwidth_eff)
    if dev.overlap:
        compute_ms = 1e3 * flops / (dev.tflops * 1e12 * dev.flops_eff)
        roofline = max(memory_ms, compute_ms)
    else:  # the weight stream already computed one token per row; every other token adds its FLOPs
        extra = flops - rows * shape.forward_flops(1, 1, context, n)
        roofline = memory_ms + 1e3 * max(extra, 0.0) / (dev.tflops * 1e12 * dev.flops_eff)
    return roofline + n * dev.layer_overhead_ms + dev.forward_overhead_ms + (rows - 1) * dev.row_overhead_ms


def mat(agree: float, k: int) -> float:
    """Mean tokens per round with k drafts at per-token agreement `agree` (k = 0: plain decoding, 1 token)."""
    if k <= 0:
        return 1.0
    if agree >= 1.0:
        return k + 1.0
    return (1 - agree ** (k + 1)) / (1 - agree)


@dataclass(frozen=True)
class Replica:
    """One target replica (TP ranks count as GPUs) and, if it speculates, its draft."""

    target: ModelShape  # the whole model; `tp` ranks each run `target.shard(tp)`
    dev: Device
    tp: int = 1
    draft: ModelShape | None = None
    draft_depth: float | None = None  # mean layers a draft token runs (adaptive exits); default: all its layers
    agree: float = 0.0
    context: int = 512
    dtype_bytes: int = 2
    cross_node_ms: float = CROSS_NODE_MS  # per deployment call the router makes to another node

    def verify_ms(self, batch: int, positions: int) -> float:
        return forward_ms(self.target.shard(self.tp), self.dev, batch, positions, self.context, self.dtype_bytes)

    def step_ms(self, batch: int) -> float:
        return self.verify_ms(batch, 1)

    def draft_ms(self, batch: int) -> float:
        """One draft depth: B rows x 1 position through the layers a draft token runs on average, and a head."""
        if self.draft is None:
            return 0.0
        depth = self.draft_depth if self.draft_depth is not None else self.draft.layers
        layers = int(round(depth))
        return forward_ms(self.draft, self.dev, batch, 1, self.context, self.dtype_bytes, layers) + \
            self.dev.draft_depth_overhead_ms

    def round_ms(self, batch: int, k: int, draft_elsewhere: bool = False) -> float:
        """Target-GPU time of one round; a shared draft drafts on its own GPU (rounds of two batches interleave,
        so the target's GPU verifies one batch while the other drafts)."""
        dev, extra_rows = self.dev, max(batch, 1) - 1
        drafting = 0.0 if (k == 0 or draft_elsewhere) else k * self.draft_ms(batch)
        spec = 0.0 if k == 0 else dev.spec_round_overhead_ms + extra_rows * dev.spec_row_overhead_ms
        return drafting + self.verify_ms(batch, k + 1) + dev.round_overhead_ms + extra_rows * dev.round_row_overhead_ms \
            + spec

    def calls_per_round(self, k: int, draft_elsewhere: bool = False) -> int:
        """Deployment calls a round makes from the router: the target's verify, and a shared draft's propose."""
        return 2 if (draft_elsewhere and k > 0) else 1

    def latency_ms(self, batch: int, k: int, draft_elsewhere: bool = False) -> float:
        """A stream's wall time per round: drafting and verifying in turn, plus every call's crossing of nodes."""
        return self.round_ms(batch, k) + self.calls_per_round(k, draft_elsewhere) * self.cross_node_ms

    def tokens_per_s(self, batch: int, k: int, draft_elsewhere: bool = False) -> float:
        return 1e3 * batch * mat(self.agree, k) / self.round_ms(batch, k, draft_elsewhere)

    def best_k(self, batch: int, max_k: int = 12, draft_elsewhere: bool = False) -> int:
        """The draft length that maximises throughput at this batch (0: plain decoding): what load-aware
        speculation should pick."""
        if self.draft is None:
            return 0
        ks = range(0, max_k + 1)
        return max(ks, key=lambda k: (self.tokens_per_s(batch, k, draft_elsewhere), -k))
