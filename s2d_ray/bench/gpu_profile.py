"""`s2d bench gpu-profile --out DIR [--tiny] [--compile]`: where a GPU decode step's time goes.

An eager decode step of a 7B-shaped model on a fast GPU is bound by the host (kernel launches, Python), not by
streaming the weights. This run separates (1) Hugging Face's own decode step (its model
forward with its DynamicCache) from (2) our verifier's step (slot cache, masks, row table) and (3) the engine's round
around it; profiles the engine's rounds (host time by op, synchronisations); and times the fastest plain decoding a
user could pick in transformers: `generate` eager, and with a static cache compiled (`--compile`).
Random bf16 weights: costs do not depend on them. `--tiny` is the CPU dry run of the same code.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from ..fleet.measure import median_ms, random_llama, sync
from .gpu_check import shapes

logger = logging.getLogger(__name__)


def hf_step_ms(model, prompt: torch.Tensor, device: torch.device, steps: int) -> float:
    """ms per decode step of the model's own forward with its own cache (no generate loop)."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(prompt, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
        sync(device)
    return 1e3 * (time.perf_counter() - t0) / steps


def generate_tok_s(model, prompt: torch.Tensor, new: int, device: torch.device, **kwargs) -> float:
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False, **kwargs)
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kwargs)
        sync(device)
    return (out.shape[1] - prompt.shape[1]) / (time.perf_counter() - t0)


def run(out_dir: Path, tiny: bool, compile_: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from ..build import build_verifier, make_engine
    from ..core.engine import GenerationRequest
    from ..core.types import ScoreRequest

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = shapes(tiny)["llama-2-7b"]  # gpu_check's shapes: the same tiny widths for the dry run
    layers = 4 if tiny else shape.layers
    model = random_llama(shape, layers, torch.bfloat16, device)
    ctx = [(7 * i) % (shape.vocab - 3) + 3 for i in range(128)]
    prompt = torch.tensor([ctx], device=device)
    res: dict = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (dry run)",
                 "layers": layers, "torch": torch.__version__}
    out_dir.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (out_dir / "gpu_profile.json").write_text(json.dumps(res, indent=1, default=str))

    steps = 8 if tiny else 32
    res["hf_step_ms"] = hf_step_ms(model, prompt, device, steps)
    logger.info("HF forward + DynamicCache: %.2f ms per step", res["hf_step_ms"])
    verifier = build_verifier(model)
    toks = list(ctx)
    verifier.score([ScoreRequest("v", toks, 1)])

    def our_step() -> None:
        toks.append(5)
        verifier.score([ScoreRequest("v", toks, 1)])

    res["verifier_step_ms"] = median_ms(our_step, device, steps, warmup=1)
    logger.info("our verifier step: %.2f ms", res["verifier_step_ms"])
    engine = make_engine(build_verifier(model))
    engine.generate([GenerationRequest("w", ctx, 4)])
    sync(device)
    t0 = time.perf_counter()
    r = engine.generate([GenerationRequest("e", ctx, steps)])[0]
    sync(device)
    res["engine_ar_round_ms"] = 1e3 * (time.perf_counter() - t0) / r.metrics["num_target_forwards"]
    logger.info("engine ar round: %.2f ms", res["engine_ar_round_ms"])
    save()

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        engine.generate([GenerationRequest("p", ctx, 8)])
        sync(device)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=35)
    (out_dir / "gpu_profile_ops.txt").write_text(table)
    events = {e.key: (e.count, e.self_cpu_time_total / 1e3) for e in prof.key_averages()}
    res["profile_8_rounds"] = {k: {"calls": c, "self_cpu_ms": round(ms, 2)} for k, (c, ms) in
                               sorted(events.items(), key=lambda kv: -kv[1][1])[:25]}
    res["syncs"] = {k: events[k][0] for k in events if "ynchronize" in k or k in ("aten::item",
                                                                               "aten::_local_scalar_dense")}
    logger.info("syncs over 8 rounds: %s", res["syncs"])
    save()

    new = 16 if tiny else 64
    res["hf_generate_tok_s"] = generate_tok_s(model, prompt, new, device)
    logger.info("HF generate eager: %.1f tok/s", res["hf_generate_tok_s"])
    save()
    if compile_:
        t0 = time.perf_counter()
        try:
            res["hf_generate_static_compiled_tok_s"] = generate_tok_s(model, prompt, new, device,
                                                                      cache_implementation="static")
            res["hf_generate_static_compiled_tok_s_2"] = generate_tok_s(model, prompt, new, device,
                                                                        cache_implementation="static")
        except Exception as exc:  # noqa: BLE001 - record and keep what was measured
            res["compile_error"] = f"{type(exc).__name__}: {exc}"
        res["compile_seconds"] = time.perf_counter() - t0
        logger.info("HF generate static cache (compiled): %s", res.get("hf_generate_static_compiled_tok_s_2"))
        save()
    return res


def summary(res: dict) -> str:
    """Every figure but the per-op profile, as JSON."""
    return json.dumps({k: v for k, v in res.items() if k != "profile_8_rounds"}, indent=1, default=str) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_profile", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="tiny widths: a dry run on CPU")
    p.add_argument("--compile", action="store_true", help="also transformers' static cache, compiled (minutes)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    res = run(args.out, args.tiny, args.compile)
    print(summary(res), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
