"""`s2d bench plan-check`: does the fleet model, given this CPU's measured bandwidth, FLOP/s and overheads, predict
what the engine actually does here? Measures the device row, predicts `ar` and `s2d` tokens/s at batch 1 and 8,
runs the in-process engine on the same prompts, and prints the errors.

The prediction uses only: the model's shapes, the device row measured here (never the engine's own timings), and
the draft's per-token agreement from the calibration profile (as `s2d plan` does). A second S2D prediction uses the
run's own measured MAT, so the cost model's error and the acceptance model's error can be told apart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from statistics import median

import torch

from ..build import build_engine, load_profile, load_target, set_threads
from ..config import DraftConfig, EngineConfig, SpecConfig, TargetConfig
from ..core.engine import GenerationRequest
from ..fleet.hardware import DEVICES
from ..fleet.measure import device_fields, measure_device
from ..fleet.model import DTYPE_BYTES, Replica, mat
from ..fleet.plan import draft_shape_of, model_shape
from .machine import machine_info
from .steps import bench_prompts

MAX_ERROR = 0.15


@dataclass
class PlanCheck:
    target: str = "smollm2-135m-instruct"
    draft: str = "smollm2-135m-s2d"
    dtype: str = "bfloat16"
    threads: int = 1
    tokens: int = 64
    batches: tuple[int, ...] = (1, 8)
    repeats: int = 3
    quick: bool = False


def predict(rep: Replica, batch: int, k: int, measured_mat: float | None = None) -> float:
    """Tokens/s of one replica at this batch and draft length; with `measured_mat`, that MAT replaces the model's."""
    if measured_mat is None:
        return rep.tokens_per_s(batch, k)
    return 1e3 * batch * measured_mat / rep.round_ms(batch, k)


def run_engine(built, prompts: list[list[int]], tokens: int, repeats: int) -> tuple[float, float]:
    """Median tokens/s over repeats of one batch (all prompts together), and the run's mean acceptance length."""
    engine = built.engine
    engine.generate([GenerationRequest("warm", prompts[0], 4)])
    rates, mats = [], []
    for r in range(repeats):
        reqs = [GenerationRequest(f"r{r}-{i}", p, tokens) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        out = engine.generate(reqs)
        rates.append(sum(len(o.token_ids) for o in out) / (time.perf_counter() - t0))
        mats += [o.metrics["mean_acceptance_length"] for o in out]
    return median(rates), sum(mats) / len(mats)


def run_check(run: PlanCheck) -> dict:
    set_threads(run.threads)
    dtype = getattr(torch, run.dtype)
    cfg = EngineConfig(target=TargetConfig(name=run.target, dtype=run.dtype), draft=DraftConfig(source=run.draft),
                       num_threads=run.threads)
    target = load_target(cfg, device="cpu")
    shape, (dshape, depth) = model_shape(run.target), draft_shape_of(run.draft)
    measured = measure_device(shape, dtype, torch.device("cpu"), depth, quick=run.quick)
    dev = DEVICES["this-cpu"].at(**device_fields(measured))
    profile = load_profile(cfg) or {}
    agree = float(profile.get("on_path", {}).get("s2d_agree", 0.0))
    k = int(profile.get("k", 5))
    prompts = bench_prompts(target.tokenizer, None, max(run.batches))
    context = int(sum(len(p) for p in prompts) / len(prompts) + run.tokens / 2)
    rep = Replica(shape, dev, draft=dshape, draft_depth=depth, agree=agree, context=context,
                  dtype_bytes=DTYPE_BYTES[run.dtype])
    engines = {"ar": build_engine(cfg.model_copy(update={"spec": SpecConfig(mode="ar")}), target),
               "s2d": build_engine(cfg.model_copy(update={"spec": SpecConfig(mode="s2d", policy="fixed", k=k)}),
                                   target)}
    rows = []
    for batch in run.batches:
        for mode, built in engines.items():
            tps, mat_run = run_engine(built, prompts[:batch], run.tokens, run.repeats)
            kk = 0 if mode == "ar" else k
            pred = predict(rep, batch, kk)
            row = {"mode": mode, "batch": batch, "k": kk, "measured_tps": tps, "predicted_tps": pred,
                   "error": pred / tps - 1, "measured_mat": mat_run, "predicted_mat": mat(agree, kk)}
            if mode == "s2d":
                row["predicted_tps_measured_mat"] = predict(rep, batch, kk, mat_run)
                row["error_measured_mat"] = row["predicted_tps_measured_mat"] / tps - 1
            rows.append(row)
    return {"machine": machine_info(), "run": run.__dict__, "device_measured": measured, "agree": agree, "k": k,
            "context": context, "rows": rows, "max_abs_error": max(abs(r["error"]) for r in rows)}


def check_markdown(r: dict) -> str:
    m = r["device_measured"]
    lines = [f"This CPU, {r['run']['threads']} thread(s), {r['run']['dtype']}: bandwidth {m['bandwidth_gbs']:.1f} GB/s, "
             f"{m['tflops'] * 1e3:.0f} GFLOP/s, {m['layer_overhead_ms']:.3f} ms/layer, {m['forward_overhead_ms']:.3f} "
             f"ms/forward, {m['round_overhead_ms']:.3f} ms/round, {m['draft_depth_overhead_ms']:.3f} ms/draft depth; "
             f"agreement {r['agree']:.3f} (profile), k {r['k']}, context ~{r['context']}.", "",
             "| mode | batch | k | measured tok/s | predicted tok/s | error | MAT measured / modelled | "
             "predicted with measured MAT (error) |", "|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        extra = (f"{row['predicted_tps_measured_mat']:.1f} ({row['error_measured_mat']:+.1%})"
                 if "error_measured_mat" in row else "-")
        lines.append(f"| {row['mode']} | {row['batch']} | {row['k']} | {row['measured_tps']:.1f} | "
                     f"{row['predicted_tps']:.1f} | {row['error']:+.1%} | {row['measured_mat']:.2f} / "
                     f"{row['predicted_mat']:.2f} | {extra} |")
    verdict = "within" if r["max_abs_error"] <= MAX_ERROR else "OUTSIDE"
    lines += ["", f"Largest error {r['max_abs_error']:.1%}: {verdict} the {MAX_ERROR:.0%} target."]
    return "\n".join(lines) + "\n"
