"""Measure a device's row of the hardware table: effective bandwidth and FLOP/s, and the fixed costs a roofline
misses, each with a model whose shapes isolate it. Works on CPU and CUDA (`scripts/gpu_check.sh` runs it there).

- bandwidth: the matmuls of one forward of the model as matrix-vector products (the weights stream from memory,
  as in a decode step; at the model's own widths, since small matrices run below a big one's rate on a CPU);
- FLOP/s: the same matmuls over 256 rows (the peak, which GPUs overlap with the weight stream); on a CPU core,
  which streams and computes in turn, the marginal rate of extra tokens through two real layers of the model's
  shape (random weights), so attention and elementwise work count at their real share;
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


def matmul_rates(shape: ModelShape, dtype: torch.dtype, device: torch.device, tokens: int = 256, few: int = 16,
                 repeat: int = 10) -> dict:
    """The matmuls of one forward of `shape`: GB/s as matrix-vector products (1 token: the weights stream from
    memory, as in a decode step); peak TFLOP/s with `tokens` rows (compute-bound); and the marginal TFLOP/s of
    going from 1 to `few` rows (what each extra verified token costs where compute does not hide under the weight
    stream, as on one CPU core). Only the matmuls: attention, norms and per-op overheads are measured apart."""
    mats = forward_matrices(shape, dtype, device)
    sizes = (1, few, tokens)
    inputs = {n: {w.shape[1]: torch.randn(n, w.shape[1], device=device).to(dtype) for w in mats} for n in sizes}

    def stream(n: int) -> None:
        for w in mats:
            torch.nn.functional.linear(inputs[n][w.shape[1]], w)

    params = sum(w.numel() for w in mats)
    if device.type == "cuda":  # as the engine runs them there: one CUDA graph, no launch gaps between the matmuls
        graphs = {}
        for n in sizes:
            stream(n)
            torch.cuda.synchronize()
            graphs[n] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[n]):
                stream(n)
        ms = {n: median_ms(graphs[n].replay, device, repeat if n < tokens else max(repeat // 2, 2)) for n in sizes}
        del graphs
    else:
        ms = {n: median_ms(lambda n=n: stream(n), device, repeat if n < tokens else max(repeat // 2, 2))
              for n in sizes}
    return {"bandwidth_gbs": params * mats[0].element_size() / (ms[1] * 1e-3) / 1e9,
            "peak_tflops": 2 * tokens * params / (ms[tokens] * 1e-3) / 1e12,
            "marginal_tflops": 2 * (few - 1) * params / (max(ms[few] - ms[1], 1e-6) * 1e-3) / 1e12}


def token_tflops(shape: ModelShape, dtype: torch.dtype, device: torch.device, context: int = 256, few: int = 16,
                 layers: int = 2, repeat: int = 10) -> float:
    """The marginal rate of extra tokens through real decoder layers of `shape` (random weights, `layers` of them,
    our verifier and cache): modelled FLOPs of `few` positions over one, per second of their time difference. It
    includes what the FLOP count leaves out (attention kernels, norms, activations), at their real proportions."""
    from ..build import build_verifier
    from ..core.types import ScoreRequest

    model = random_llama(shape, layers, dtype, device)
    verifier = build_verifier(model)
    ctx = [(13 * i) % (shape.vocab - 3) + 3 for i in range(context)]
    verifier.score([ScoreRequest("t", ctx, 1)])
    extra = ctx[:few]
    one = median_ms(lambda: verifier.score([ScoreRequest("t", ctx + extra[:1], 1)]), device, repeat)
    many = median_ms(lambda: verifier.score([ScoreRequest("t", ctx + extra, few)]), device, repeat)
    flops = shape.forward_flops(1, few, context, layers) - shape.forward_flops(1, 1, context, layers)
    return flops / (max(many - one, 1e-6) * 1e-3) / 1e12


def overheads(dtype: torch.dtype, device: torch.device, layers: int = 30, draft_layers: int = 6, context: int = 256,
              repeat: int = 10) -> dict:
    """ms per layer per forward, per forward, per extra row of a forward, per engine round and per extra row of it
    (outside forwards), per draft depth, and per speculative round and row beyond its forwards (acceptance,
    the draft's catch-up), measured on models of tiny width (hidden 64) with the real layer counts."""
    from ..build import build_drafter, build_verifier, make_engine, make_kernels
    from ..core.draft import SortedDraft
    from ..core.engine import GenerationRequest
    from ..core.policy import FixedK
    from ..core.types import DraftRequest, SamplingParams, ScoreRequest

    tiny = ModelShape("tiny", layers, 64, 128, 2, 2, 32, 256)
    ctx = [(7 * i) % 250 + 3 for i in range(context)]
    kernels = make_kernels()
    fwd = {}
    lo, layers = 1, max(layers, draft_layers, 4)  # two depths separate per-layer from per-forward cost
    for n in (lo, layers):
        model = random_llama(tiny, n, dtype, device)
        verifier = build_verifier(model, kernels=kernels)
        verifier.score([ScoreRequest("s", ctx, 1)])
        fwd[n] = median_ms(lambda: verifier.score([ScoreRequest("s", ctx + [5], 1)]), device, repeat)
    per_layer = max((fwd[layers] - fwd[lo]) / (layers - lo), 0.0)
    fixed = max(fwd[lo] - lo * per_layer, 0.0)
    rows = 8
    for i in range(rows):
        verifier.score([ScoreRequest(f"r{i}", ctx, 1)])
    wide = median_ms(lambda: verifier.score([ScoreRequest(f"r{i}", ctx + [5], 1) for i in range(rows)]), device, repeat)
    per_row = max((wide - fwd[layers]) / (rows - 1), 0.0)
    draft = SortedDraft.cut(model, "tiny", draft_layers, [draft_layers], kernels=kernels)
    drafter = build_drafter(draft)
    k = 8
    flips = [[DraftRequest("d", ctx[:-1] + [last], k, SamplingParams())] for last in (11, 12)]
    calls = [0]

    def propose() -> None:
        calls[0] += 1
        drafter.propose(flips[calls[0] % 2])

    depth_ms = median_ms(propose, device, repeat) / k

    def round_ms(spec: bool, batch: int, gen: int = 24) -> float:
        """ms per engine round: `batch` rows decoding together, plain or with k = 1 drafts (the tiny model's
        acceptance does not matter: time is divided by the rounds actually run)."""
        engine = make_engine(build_verifier(model, kernels=kernels), build_drafter(draft) if spec else None,
                             policy=FixedK(1))
        engine.generate([GenerationRequest("w", ctx, 4)])
        per_round = []
        for r in range(max(repeat // 3, 3)):
            t0 = time.perf_counter()
            res = engine.generate([GenerationRequest(f"g{r}-{i}", ctx, gen) for i in range(batch)])
            sync(device)
            per_round.append(1e3 * (time.perf_counter() - t0) / max(x.metrics["num_target_forwards"] for x in res))
        return median(per_round)

    ar = {b: round_ms(False, b) for b in (1, rows)}
    spec = {b: round_ms(True, b) for b in (1, rows)}
    # What a round costs beyond its forwards (plain), and what drafting adds beyond its forwards (speculative).
    round_ovh = max(ar[1] - fwd[layers], 0.0)
    round_row = max((ar[rows] - ar[1]) / (rows - 1) - per_row, 0.0)
    residual = {b: spec[b] - ar[b] - (depth_ms + (b - 1) * per_row) for b in (1, rows)}
    spec_ovh = max(residual[1], 0.0)
    spec_row = max((residual[rows] - residual[1]) / (rows - 1), 0.0)
    return {"layer_overhead_ms": per_layer, "forward_overhead_ms": fixed, "row_overhead_ms": per_row,
            "round_overhead_ms": round_ovh, "round_row_overhead_ms": round_row,
            "draft_depth_overhead_ms": max(depth_ms - fixed - draft_layers * per_layer, 0.0),
            "spec_round_overhead_ms": spec_ovh, "spec_row_overhead_ms": spec_row,
            "tiny_forward_ms": fwd, "tiny_ar_round_ms": ar, "tiny_s2d_round_ms": spec, "tiny_draft_depth_ms": depth_ms}



def measure_device(shape: ModelShape, dtype: torch.dtype, device: torch.device, draft_layers: int = 6,
                   quick: bool = False) -> dict:
    """The measured fields of a `Device` row (see hardware.py) in the serving dtype, on `shape`'s matmuls."""
    out = matmul_rates(shape, dtype, device, 16 if quick else 256, 8 if quick else 16, 3 if quick else 10)
    # Where compute overlaps the weight stream (GPUs) the roofline takes the peak; on a CPU core it adds up.
    out["overlap"] = device.type == "cuda"
    if not out["overlap"]:
        out["token_tflops"] = token_tflops(shape, dtype, device, 32 if quick else 256, 8 if quick else 16,
                                           repeat=3 if quick else 10)
    out["tflops"] = out["peak_tflops"] if out["overlap"] else out["token_tflops"]
    out["measured_on"] = shape.name
    out.update(overheads(dtype, device, shape.layers, draft_layers, 32 if quick else 256, 3 if quick else 10))
    return out


def device_fields(measured: dict) -> dict:
    """The entries of `measure_device`'s result that are `Device` fields."""
    keep = ("bandwidth_gbs", "tflops", "overlap", "layer_overhead_ms", "forward_overhead_ms", "row_overhead_ms",
            "round_overhead_ms", "round_row_overhead_ms", "draft_depth_overhead_ms", "spec_round_overhead_ms",
            "spec_row_overhead_ms")
    return {k: measured[k] for k in keep}
