"""`s2d bench plan-check`: does the fleet model, given this CPU's measured bandwidth, FLOP/s and overheads, predict
what the engine actually does here? Measures the device row, predicts `ar` and `s2d` tokens/s at batch 1 and 8,
runs the in-process engine on the same prompts, and prints the errors.

The prediction uses only: the model's shapes, the device row measured here (never the engine's own timings), and
the draft's per-token agreement from the calibration profile (as `s2d plan` does). A second S2D prediction uses the
run's own measured MAT, so the cost model's error and the acceptance model's error can be told apart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import median

import torch

from ..build import build_engine, load_profile, load_target, set_threads
from ..config import (SPEC_BENCH_QUESTIONS, TRAIN_DATA, DraftConfig, EngineConfig, SpecConfig, TargetConfig,
                      data_file)
from ..core.engine import GenerationRequest
from ..fleet.hardware import DEVICES
from ..fleet.measure import device_fields, measure_device
from ..fleet.model import DTYPE_BYTES, Replica, forward_ms, mat
from ..fleet.plan import draft_shape_of, model_shape
from ..hardware import machine_info
from ..prompts import encode_messages, sample_prompts
from ..train.data import messages_of

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
    prompts: str = "heldout"  # heldout: the calibration set's distribution; specbench: other prompts
    data: str | None = None  # their file (instructions or Spec-Bench questions); None: the data directory's


def predict(rep: Replica, groups: list[list[int]], k: int, tokens: int, measured_mat: float | None = None) -> float:
    """Tokens/s of batches run one after another (`groups`: each batch's prompt lengths), each generating `tokens`
    per row after a prefill as wide as its longest prompt (as the engine pads it; the draft prefills too when it
    drafts), decoding at context prompt + tokens / 2; with `measured_mat`, that MAT replaces the model's."""
    m = mat(rep.agree, k) if measured_mat is None else measured_mat
    total_ms = 0.0
    for lengths in groups:
        batch, width = len(lengths), max(lengths)
        at = replace(rep, context=int(sum(lengths) / batch + tokens / 2))
        total_ms += forward_ms(at.target.shard(at.tp), at.dev, batch, width, 0, at.dtype_bytes)
        if k and at.draft is not None:
            total_ms += forward_ms(at.draft, at.dev, batch, width, 0, at.dtype_bytes,
                                   int(at.draft_depth or at.draft.layers))
        total_ms += tokens / m * at.round_ms(batch, k)
    return 1e3 * tokens * sum(len(g) for g in groups) / total_ms


def check_prompts(tokenizer, kind: str, n: int, data: str | None = None) -> list[list[int]]:
    """Chat-templated first turns: held-out instructions (the calibration profile's own distribution, so its
    acceptance applies) or Spec-Bench questions (how acceptance transfers to other prompts), from `data` or the
    data directory's file of that kind."""
    if kind == "specbench":
        return sample_prompts(tokenizer, Path(data) if data else data_file(SPEC_BENCH_QUESTIONS, "--data"), n)
    from ..train.selfdistill import pick_rows

    heldout = Path(data) if data else data_file(TRAIN_DATA, "--data")  # calibrate's default --data
    rows = pick_rows(heldout, n, 0, "heldout", {"gsm8k_train": 0.25})
    if len(rows) < n:
        raise ValueError(f"{heldout} has fewer than {n} held-out instructions")
    return [encode_messages(tokenizer, [m for m in messages_of(r) if m["role"] == "user"][:1]) for r in rows]


def run_engine(built, groups: list[list[list[int]]], tokens: int, repeats: int) -> tuple[float, float]:
    """Median tokens/s over repeats of running every group as one batch, one group after another, and the mean
    acceptance length of the run."""
    engine = built.engine
    engine.generate([GenerationRequest("warm", groups[0][0], 4)])
    rates, mats = [], []
    for r in range(repeats):
        t0, n = time.perf_counter(), 0
        for g, prompts in enumerate(groups):
            out = engine.generate([GenerationRequest(f"r{r}-{g}-{i}", p, tokens) for i, p in enumerate(prompts)])
            n += sum(len(o.token_ids) for o in out)
            mats += [o.metrics["mean_acceptance_length"] for o in out]
        rates.append(n / (time.perf_counter() - t0))
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
    prompts = check_prompts(target.tokenizer, run.prompts, max(run.batches), run.data)
    base = Replica(shape, dev, draft=dshape, draft_depth=depth, agree=agree, dtype_bytes=DTYPE_BYTES[run.dtype])
    engines = {"ar": build_engine(cfg.model_copy(update={"spec": SpecConfig(mode="ar")}), target),
               "s2d": build_engine(cfg.model_copy(update={"spec": SpecConfig(mode="s2d", policy="fixed", k=k)}),
                                   target)}
    rows = []
    for batch in run.batches:  # every batch size runs the same prompts: groups of `batch`
        groups = [prompts[i : i + batch] for i in range(0, len(prompts) - batch + 1, batch)]
        lengths = [[len(p) for p in g] for g in groups]
        for mode, built in engines.items():
            tps, mat_run = run_engine(built, groups, run.tokens, run.repeats)
            kk = 0 if mode == "ar" else k
            pred = predict(base, lengths, kk, run.tokens)
            row = {"mode": mode, "batch": batch, "k": kk, "prompt_lengths": lengths,
                   "measured_tps": tps, "predicted_tps": pred, "error": pred / tps - 1, "measured_mat": mat_run, "predicted_mat": mat(agree, kk)}
            if mode == "s2d":
                row["predicted_tps_measured_mat"] = predict(base, lengths, kk, run.tokens, mat_run)
                row["error_measured_mat"] = row["predicted_tps_measured_mat"] / tps - 1
            rows.append(row)
    return {"machine": machine_info(), "run": run.__dict__, "device_measured": measured, "agree": agree, "k": k,
            "rows": rows, "max_abs_error": max(abs(r["error"]) for r in rows),
            "verify_grid": grid_errors(base, profile)}


def grid_errors(rep: Replica, profile: dict) -> dict | None:
    """The model's verify costs against the profile's calibrated grid (measured at its own context, by calibrate)."""
    grid = (profile.get("costs_ms") or {}).get("verify_grid")
    if not grid:
        return None
    context = int((profile.get("costs_measured") or {}).get("context", 256))
    at = replace(rep, context=context)  # the grid's own context
    errors = {b: {n: at.verify_ms(int(b), int(n)) / ms - 1 for n, ms in row.items()} for b, row in grid.items()}
    flat = [abs(e) for row in errors.values() for e in row.values()]
    return {"context": context, "errors": errors, "mean_abs_error": sum(flat) / len(flat), "max_abs_error": max(flat)}


def check_markdown(r: dict) -> str:
    m = r["device_measured"]
    lines = [f"This CPU, {r['run']['threads']} thread(s), {r['run']['dtype']}: bandwidth {m['bandwidth_gbs']:.1f} GB/s, "
             f"{m['tflops'] * 1e3:.0f} GFLOP/s (peak {m['peak_tflops'] * 1e3:.0f}), {m['layer_overhead_ms']:.3f} "
             f"ms/layer, {m['forward_overhead_ms']:.3f} ms/forward, {m['row_overhead_ms']:.3f} ms/row, "
             f"{m['round_overhead_ms']:.3f} ms/round, {m['draft_depth_overhead_ms']:.3f} ms/draft depth; "
             f"agreement {r['agree']:.3f} (profile), k {r['k']}, {r['run']['prompts']} prompts; predictions include the prefill.", "",
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
    g = r.get("verify_grid")
    if g:
        cols = list(next(iter(g["errors"].values())))
        lines += ["", f"One target forward, model / calibrated grid - 1 (context {g['context']}; mean |error| "
                      f"{g['mean_abs_error']:.1%}, max {g['max_abs_error']:.1%}):", "",
                  "| B \\ n | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        lines += [f"| {b} | " + " | ".join(f"{row[c]:+.0%}" for c in cols) + " |" for b, row in g["errors"].items()]
    return "\n".join(lines) + "\n"


# --- the same model against a GPU run (scripts/gpu_check.sh) ----------------------------------------------------------
def gpu_errors(result: dict, prompt_tokens: int = 128, tokens: int = 64) -> list[dict]:
    """The fleet model's tokens/s for the engine rounds a gpu_check run timed (7B shape, random weights, prompts of
    `prompt_tokens`, `tokens` new per row, a cut draft of the first layers for `s2d`), from that run's OWN device
    row (matmul rates and tiny-width overheads, never the engine's timings), against what the engine measured.
    The run's measured MAT (random weights accept ~nothing) is used, so only the cost model is tested. Eager rounds
    are predicted only from a row measured eagerly (the graphs run's row prices graphed forwards)."""
    from ..fleet.hardware import Device
    from ..fleet.shapes import SHAPES

    row = result["device_row"]
    dev = Device("measured", memory_gb=0, bandwidth_eff=1.0, flops_eff=1.0, **device_fields(row))
    shape = SHAPES["llama-2-7b"]
    draft_layers = 4 if result.get("engine_layers", 32) == shape.layers else 2
    graphed_row = any("+graphs" in m for b in result["engine"].values() for m in b)
    out = []
    for batch, modes in result["engine"].items():
        for mode, m in modes.items():
            graphs = mode.endswith("+graphs")
            base = mode.removesuffix("+graphs")
            if base == "tree" or graphs != graphed_row:
                continue  # trees are not in the model; eager rounds need an eagerly measured row
            k = 0 if base == "ar" else 4
            rep = Replica(shape, dev, draft=shape.with_layers(draft_layers) if k else None, draft_depth=draft_layers)
            b = int(batch)
            measured_mat = m["tokens"] / b / m["rounds"]
            pred = predict(rep, [[prompt_tokens] * b], k, tokens, measured_mat)
            out.append({"mode": mode, "batch": b, "measured_tps": m["tokens_per_s"], "predicted_tps": pred,
                        "error": pred / m["tokens_per_s"] - 1, "measured_ms_per_round": m["ms_per_round"]})
    return out


def gpu_markdown(result: dict, rows: list[dict]) -> str:
    lines = [f"{result.get('device_name')}, {result.get('dtype')}, torch {result.get('torch')}: the model from this run's "
             f"device row vs the engine's measured rounds (7B shape, random weights)", "",
             "| mode | batch | measured tok/s | predicted tok/s | error |", "|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['batch']} | {r['measured_tps']:.1f} | {r['predicted_tps']:.1f} | {r['error']:+.1%} |"
              for r in rows]
    worst = max(abs(r["error"]) for r in rows)
    lines += ["", f"Largest error {worst:.1%}: {'within' if worst <= MAX_ERROR else 'OUTSIDE'} the {MAX_ERROR:.0%} target."]
    return "\n".join(lines) + "\n"
