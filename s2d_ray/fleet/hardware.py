"""Devices: public peak memory bandwidth and dense bf16 FLOP/s, what fraction of them real kernels reach, and the
fixed costs a roofline misses (per-layer launch/Python overhead, the engine's own work per round).

GPU peaks are the vendors' datasheet figures (SXM parts; dense, no sparsity). The efficiencies and overheads of GPUs
were measured on one H200 by `scripts/gpu_check.sh` and are assumed for the other parts (see docs/FLEET.md); this CPU's row is
measured by `s2d bench plan-check` (bandwidth: a large reduction; FLOP/s: a large matmul; overheads: the engine
running a model of tiny width with the real layer count)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Device:
    name: str
    bandwidth_gbs: float  # peak memory bandwidth, GB/s
    tflops: float  # dense peak in the serving dtype (bf16 on GPUs), TFLOP/s
    memory_gb: float
    bandwidth_eff: float = 0.8  # share of peak bandwidth a decode GEMV reaches
    flops_eff: float = 0.6  # share of peak FLOP/s the verify GEMMs reach
    layer_overhead_ms: float = 0.3  # per decoder layer per forward beyond its roofline (eager HF layers: launch-bound)
    forward_overhead_ms: float = 0.3  # per forward: embedding, mask, rotary, the verifier's bookkeeping
    row_overhead_ms: float = 0.02  # per extra row per forward (row gathers, per-row mask and bookkeeping)
    overlap: bool = True  # compute hides under the weight stream (roofline max); False: they add (one CPU core)
    round_overhead_ms: float = 1.0  # engine per round outside forwards (sampling, bookkeeping, host syncs)
    round_row_overhead_ms: float = 0.05  # engine per extra row per round outside forwards
    draft_depth_overhead_ms: float = 0.3  # drafter per depth beyond its forward (exit checks, sampling)
    spec_round_overhead_ms: float = 0.5  # a speculative round beyond its forwards (acceptance, draft catch-up)
    spec_row_overhead_ms: float = 0.05  # the same, per extra row
    measured: bool = False
    source: str = ""

    def at(self, **measured) -> "Device":
        return replace(self, **measured)


# Datasheets: NVIDIA L40S (864 GB/s, 362 TFLOP/s bf16 dense, 48 GB), A100 80GB SXM (2039 GB/s, 312, 80 GB),
# H100 SXM (3350 GB/s, 989, 80 GB), H200 SXM (4800 GB/s, 989, 141 GB).
# The H200 row is MEASURED (scripts/gpu_check.sh, the engine with CUDA graphs; BENCHMARKS.md, GPU rounds): the
# matmuls of a 7B-shaped forward inside one graph reach 3202 GB/s (0.67 of peak) as matrix-vector products and 579
# TFLOP/s (0.59) at 256 rows; overheads from tiny-width models with the real layer count. The other GPUs keep their
# datasheet peaks with the H200's measured efficiencies and overheads (same software; not measured).
_H200 = dict(bandwidth_eff=0.667, flops_eff=0.586, layer_overhead_ms=0.081, forward_overhead_ms=1.278,
             row_overhead_ms=0.126, round_overhead_ms=1.727, round_row_overhead_ms=0.209, draft_depth_overhead_ms=0.0,
             spec_round_overhead_ms=0.0, spec_row_overhead_ms=0.868)
_GPU = "datasheet peaks; efficiencies and overheads as measured on one H200 (CUDA graphs), not on this part"
DEVICES: dict[str, Device] = {
    "l40s": Device("l40s", 864, 362, 48, **_H200, source=_GPU),
    "a100": Device("a100", 2039, 312, 80, **_H200, source=_GPU),
    "h100": Device("h100", 3350, 989, 80, **_H200, source=_GPU),
    "h200": Device("h200", 4800, 989, 141, **_H200, measured=True,
                   source="scripts/gpu_check.sh on one H200, bf16, CUDA graphs"),
    # The reference CPU (BENCHMARKS.md, fleet model) at 1 torch thread, bf16 (AVX512-BF16), SmolLM2-135M shapes, from
    # `s2d bench plan-check`; `s2d bench plan-check` measures the row of any other CPU. Compute and the weight stream
    # add on one core (overlap=False).
    "this-cpu": Device("this-cpu", 12.0, 0.313, 24, bandwidth_eff=1.0, flops_eff=1.0, layer_overhead_ms=0.292,
                       forward_overhead_ms=0.248, row_overhead_ms=1.348, round_overhead_ms=0.412,
                       round_row_overhead_ms=0.669, draft_depth_overhead_ms=0.0, spec_round_overhead_ms=2.082,
                       spec_row_overhead_ms=0.0, overlap=False, measured=True,
                       source="s2d bench plan-check, 1 thread, bf16, SmolLM2-135M shapes"),
}


def device(name: str) -> Device:
    try:
        return DEVICES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICES)}") from None
