"""Measure a device's row of the hardware table: effective bandwidth and FLOP/s, and the fixed costs a roofline
misses, each with a model whose shapes isolate it. Works on CPU and CUDA (`scripts/gpu_check.sh` runs it there).

- bandwidth: the matmuls of one forward of the model as matrix-vector products (the weights stream from memory,
  as in a decode step; at the model's own widths, since small matrices run below a big one's rate on a CPU);
- FLOP/s: the same matmuls over 256 rows (compute-bound, as in a wide verification);
- overheads: the engine on Llama models of tiny width (their roofline time is ~0), so what remains is per-layer
  launch/Python cost, per-forward fixed cost, the engine's per-round work and the drafter's per-depth work.
"""

from __future__ import annotations

import time
from statistics import median

import torch

from .shapes import ModelShape


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device: torch.device, repeat: int = 10, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return median(times)


def random_llama(shape: ModelShape, layers: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A Llama with `shape`'s (per-rank) widths, `layers` layers and random weights: costs do not depend on the
    weights, so no checkpoint has to travel."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**shape.hf_config(layers), "initializer_range": 0.02})
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval().requires_grad_(False)


def forward_matrices(shape: ModelShape, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Random [out, in] weights of every matmul one forward of `shape` runs (all layers, then the LM head)."""
    h, q, kv, m = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    layer = [(q, h), (kv, h), (kv, h), (h, q), (m, h), (m, h), (h, m)]
    dims = layer * shape.layers + [(shape.head_rows or shape.vocab, h)]
    return [torch.randn(o, i, device=device).to(dtype) for o, i in dims]


def matmul_rates(shape: ModelShape, dtype: torch.dtype, device: torch.device, tokens: int = 256,
                 repeat: int = 10) -> tuple[float, float]:
    """(GB/s, TFLOP/s) of the matmuls of one forward of `shape`: as matrix-vector products (1 token: the weights
    stream from memory, as in a decode step) and as products with `tokens` rows (compute-bound, as in a wide
    verification). Only the matmuls: attention, norms and per-op overheads are measured apart."""
    mats = forward_matrices(shape, dtype, device)
    inputs = {n: {w.shape[1]: torch.randn(n, w.shape[1], device=device).to(dtype) for w in mats} for n in (1, tokens)}

    def stream(n: int) -> None:
        for w in mats:
            torch.nn.functional.linear(inputs[n][w.shape[1]], w)

    nbytes = sum(w.numel() * w.element_size() for w in mats)
    gemv_ms = median_ms(lambda: stream(1), device, repeat)
    gemm_ms = median_ms(lambda: stream(tokens), device, max(repeat // 2, 2))
    flops = 2 * tokens * sum(w.numel() for w in mats)
    return nbytes / (gemv_ms * 1e-3) / 1e9, flops / (gemm_ms * 1e-3) / 1e12


def overheads(dtype: torch.dtype, device: torch.device, layers: int = 30, draft_layers: int = 6, context: int = 256,
              repeat: int = 10) -> dict:
    """ms per layer per forward, per forward, per engine round (outside forwards) and per draft depth, measured on
    models of tiny width (hidden 64) with the real layer counts."""
    from ..core.draft import SortedDraft, SortedDrafter
    from ..core.engine import GenerationRequest, SpecEngine
    from ..core.target import TargetVerifier
    from ..core.types import DraftRequest, SamplingParams, ScoreRequest

    tiny = ModelShape("tiny", layers, 64, 128, 2, 2, 32, 256)
    ctx = [(7 * i) % 250 + 3 for i in range(context)]
    fwd = {}
    lo, layers = 1, max(layers, draft_layers, 4)  # two depths separate per-layer from per-forward cost
    for n in (lo, layers):
        model = random_llama(tiny, n, dtype, device)
        verifier = TargetVerifier(model)
        verifier.score([ScoreRequest("s", ctx, 1)])
        fwd[n] = median_ms(lambda: verifier.score([ScoreRequest("s", ctx + [5], 1)]), device, repeat)
    per_layer = max((fwd[layers] - fwd[lo]) / (layers - lo), 0.0)
    fixed = max(fwd[lo] - lo * per_layer, 0.0)
    gen = 32
    engine = SpecEngine(TargetVerifier(model))
    engine.generate([GenerationRequest("w", ctx, 4)])

    def rounds() -> None:
        engine.generate([GenerationRequest("g", ctx, gen)])

    round_ms = median_ms(rounds, device, max(repeat // 3, 3), warmup=1) / gen
    draft = SortedDraft.cut(model, "tiny", draft_layers, [draft_layers])
    drafter = SortedDrafter(draft)
    k = 8
    flips = [[DraftRequest("d", ctx[:-1] + [last], k, SamplingParams())] for last in (11, 12)]
    calls = [0]

    def propose() -> None:
        calls[0] += 1
        drafter.propose(flips[calls[0] % 2])

    depth_ms = median_ms(propose, device, repeat) / k
    return {"layer_overhead_ms": per_layer, "forward_overhead_ms": fixed,
            "round_overhead_ms": max(round_ms - fwd[layers], 0.0),
            "draft_depth_overhead_ms": max(depth_ms - fixed - draft_layers * per_layer, 0.0),
            "tiny_forward_ms": fwd, "tiny_round_ms": round_ms, "tiny_draft_depth_ms": depth_ms}


def measure_device(shape: ModelShape, dtype: torch.dtype, device: torch.device, draft_layers: int = 6,
                   quick: bool = False) -> dict:
    """The measured fields of a `Device` row (see hardware.py) in the serving dtype, on `shape`'s matmuls."""
    bandwidth, tflops = matmul_rates(shape, dtype, device, 16 if quick else 256, 3 if quick else 10)
    out = {"bandwidth_gbs": bandwidth, "tflops": tflops, "measured_on": shape.name}
    out.update(overheads(dtype, device, shape.layers, draft_layers, 32 if quick else 256, 3 if quick else 10))
    return out


def device_fields(measured: dict) -> dict:
    """The entries of `measure_device`'s result that are `Device` fields."""
    keep = ("bandwidth_gbs", "tflops", "layer_overhead_ms", "forward_overhead_ms", "round_overhead_ms",
            "draft_depth_overhead_ms")
    return {k: measured[k] for k in keep}
