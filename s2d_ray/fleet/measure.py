"""Measure a device's row of the hardware table: effective bandwidth and FLOP/s, and the fixed costs a roofline
misses, each with a model whose shapes isolate it. Works on CPU and CUDA (`scripts/gpu_check.sh` runs it there).

- bandwidth: a weight-streaming matrix-vector product (what a decode step is), bytes of the matrix / time;
- FLOP/s: a large matrix product in the serving dtype;
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


def bandwidth_gbs(dtype: torch.dtype, device: torch.device, mbytes: int = 256, repeat: int = 10) -> float:
    """GB/s of a [1, cols] x [rows, cols]^T product over a matrix of `mbytes` MB."""
    cols = 4096
    rows = max(mbytes * 2**20 // (cols * torch.finfo(dtype).bits // 8), 1)
    w = torch.randn(rows, cols, device=device).to(dtype)
    x = torch.randn(1, cols, device=device).to(dtype)
    ms = median_ms(lambda: torch.nn.functional.linear(x, w), device, repeat)
    return w.numel() * w.element_size() / (ms * 1e-3) / 1e9


def matmul_tflops(dtype: torch.dtype, device: torch.device, m: int = 512, k: int = 4096, n: int = 4096,
                  repeat: int = 5) -> float:
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(n, k, device=device).to(dtype)
    ms = median_ms(lambda: torch.nn.functional.linear(a, b), device, repeat)
    return 2 * m * k * n / (ms * 1e-3) / 1e12


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


def measure_device(dtype: torch.dtype, device: torch.device, layers: int = 30, draft_layers: int = 6,
                   quick: bool = False) -> dict:
    """The measured fields of a `Device` row (see hardware.py) in the serving dtype."""
    out = {"bandwidth_gbs": bandwidth_gbs(dtype, device, 64 if quick else 256),
           "tflops": matmul_tflops(dtype, device, *((64, 512, 512) if quick else (512, 4096, 4096)))}
    out.update(overheads(dtype, device, layers, draft_layers, 32 if quick else 256, 3 if quick else 10))
    return out
