"""`s2d bench gpu-check --out DIR [--tiny]`: what a GPU run measures (scripts/gpu_check.sh runs it with the tests).

1. the device row of the fleet model (bandwidth, FLOP/s, overheads; fleet/measure.py) in bf16;
2. verify costs by batch x positions for Llama-2-7B- and 13B-shaped models and ONE rank of Llama-2-70B at TP 4,
   with random bf16 weights: a model of few layers is timed at two depths, which separates the per-layer cost
   from the fixed one, and the whole model's cost is fixed + layers x per-layer (all-reduces of TP not included);
   the roofline prediction of the same forwards is printed beside each measurement;
3. the engine's `ar` and `s2d` round time on the 7B-shaped model, against one verify forward of the same width.
`--tiny` shrinks every width so the same code path runs on a CPU in seconds (the dry run).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from ..fleet.hardware import DEVICES, Device
from ..fleet.measure import device_fields, measure_device, random_llama, sync
from ..fleet.model import forward_ms
from ..fleet.shapes import SHAPES, ModelShape
from ..train.calibrate import measure_verify_grid

logger = logging.getLogger(__name__)

STAGES = ("row", "engine", "verify")
BATCHES = (1, 2, 4, 8, 16, 32)
POSITIONS = (1, 2, 4, 8, 16)


def shapes(tiny: bool) -> dict[str, ModelShape]:
    out = {"llama-2-7b": SHAPES["llama-2-7b"], "llama-2-13b": SHAPES["llama-2-13b"],
           "llama-2-70b-tp4-rank": SHAPES["llama-2-70b"].shard(4)}
    if tiny:
        out = {k: replace(s, hidden=s.hidden // 32, intermediate=s.intermediate // 32, head_dim=s.head_dim // 8,
                          vocab=512) for k, s in out.items()}
    return out


def scaled_grid(shape: ModelShape, dtype: torch.dtype, device: torch.device, depths: tuple[int, int], context: int,
                batches, positions, repeat: int) -> dict:
    """The whole model's verify grid from two shallow ones: fixed + layers x per-layer, per (B, n)."""
    grids = {}
    for depth in depths:
        model = random_llama(shape, depth, dtype, device)
        ctx = [(13 * i) % (shape.vocab - 3) + 3 for i in range(context)]
        grids[depth] = measure_verify_grid(model, ctx, batches, positions, repeat)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    lo, hi = depths
    out = {}
    for b in batches:
        out[str(b)] = {}
        for n in positions:
            t_lo, t_hi = 1e3 * grids[lo][b][n], 1e3 * grids[hi][b][n]
            per_layer = max((t_hi - t_lo) / (hi - lo), 0.0)
            out[str(b)][str(n)] = {"per_layer_ms": round(per_layer, 4), "fixed_ms": round(max(t_lo - lo * per_layer, 0), 4),
                                   "whole_ms": round(max(t_lo - lo * per_layer, 0) + shape.layers * per_layer, 3)}
    return out


def engine_rounds(shape: ModelShape, dtype: torch.dtype, device: torch.device, layers: int, draft_layers: int,
                  batch: int, tokens: int) -> dict:
    """ms per round of the engine in `ar`, `s2d` (a chain of fixed k = 4 from a cut draft of the first layers) and
    `tree` (the same draft's top-3 tree plus lookup candidates, the shipped proposal shape), and tokens per second.
    Random weights accept little, so this prices a round; the fleet model multiplies by acceptance."""
    from ..core.budget import SpeculationBudget, TreeShape
    from ..build import build_drafter, build_verifier, make_engine
    from ..core.draft import SortedDraft
    from ..core.engine import GenerationRequest
    from ..core.lookup import PromptLookup, TreeDrafter
    from ..core.policy import FixedK

    model = random_llama(shape, layers, dtype, device)
    prompts = [[(7 * i + j) % (shape.vocab - 3) + 3 for i in range(128)] for j in range(batch)]
    out = {}
    for graphs in (False, True):  # eager, then CUDA graphs (core/graphs.py; on a CPU the same padded forwards)
        for mode in ("ar", "s2d", "tree"):
            drafter, budget = None, None
            if mode != "ar":
                drafter = build_drafter(SortedDraft.cut(model, "random", draft_layers, [draft_layers]),
                                        cuda_graphs=graphs)
            if mode == "tree":
                drafter = TreeDrafter(drafter, PromptLookup(max_ngram=4, num_tokens=10), alone_ngram=4)
                budget = SpeculationBudget(TreeShape(width=3, lookup=True, max_nodes=24), None, max_depth=4)
            engine = make_engine(build_verifier(model, cuda_graphs=graphs), drafter, policy=FixedK(4), budget=budget)
            if graphs and device.type != "cuda":
                engine.verifier.stack.use_graphs()
            engine.generate([GenerationRequest("warm", prompts[0], 8)])
            engine.generate([GenerationRequest(f"w{i}", p, 8) for i, p in enumerate(prompts)])  # capture buckets
            sync(device)
            t0 = time.perf_counter()
            res = engine.generate([GenerationRequest(f"s{i}", p, tokens) for i, p in enumerate(prompts)])
            sync(device)
            secs = time.perf_counter() - t0
            rounds = max(r.metrics["num_target_forwards"] for r in res)  # rows share rounds: the longest counts
            n_tok = sum(len(r.token_ids) for r in res)
            key = mode + ("+graphs" if graphs else "")
            out[key] = {"seconds": secs, "tokens": n_tok, "rounds": rounds, "ms_per_round": 1e3 * secs / max(rounds, 1),
                        "tokens_per_s": n_tok / secs,
                        "draft_tokens": sum(r.metrics.get("num_draft_tokens", 0) for r in res),
                        "accepted": sum(r.metrics.get("num_accepted_draft_tokens", 0) for r in res),
                        "token_ids": [r.token_ids for r in res]}
            if graphs and out.get(mode):  # the graphed engine must decode exactly what the eager one did
                out[key]["same_tokens_as_eager"] = out[key]["token_ids"] == out[mode]["token_ids"]
            if engine.verifier.stack.graphs is not None:
                out[key]["target_replays"] = engine.verifier.stack.graphs.replays
                out[key]["target_graphs"] = sum(b.graph is not None for b in engine.verifier.stack.graphs.buckets.values())
            logger.info("engine %s batch %d: %.2f ms per round, %.1f tok/s%s", key, batch, out[key]["ms_per_round"],
                        out[key]["tokens_per_s"], f" same as eager: {out[key].get('same_tokens_as_eager')}"
                        if graphs else "")
            del engine, drafter
    for v in out.values():
        v.pop("token_ids")
    del model
    return out


def stage(result: dict, holder: dict, key: str, out_dir: Path, fn) -> None:
    """Run one stage; a failure is recorded (not raised) so later stages still run, and the JSON is written after
    every stage, so a run cut short by its time limit still returns what it measured."""
    t0 = time.perf_counter()
    try:
        holder[key] = fn()
    except Exception as exc:  # noqa: BLE001 - one device run; every stage's outcome is wanted
        logger.exception("stage %s failed", key)
        result.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"
    logger.info("stage %s: %.0f s", key, time.perf_counter() - t0)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(out_dir: Path, tiny: bool, stages: tuple[str, ...] = STAGES) -> dict:
    import transformers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (dry run)"
    logger.info("gpu check on %s (%s), %s", device, name, dtype)
    result = {"device": str(device), "device_name": name, "dtype": str(dtype), "tiny": tiny,
              "torch": torch.__version__, "transformers": transformers.__version__}
    for name_, dev in DEVICES.items():  # the datasheet rows this run can correct
        result.setdefault("table_rows", {})[name_] = dev.__dict__
    if "row" in stages:
        stage(result, result, "device_row", out_dir,
              lambda: measure_device(shapes(tiny)["llama-2-7b"], dtype, device, 12, quick=tiny))
    logger.info("device row: %s", result.get("device_row"))
    batches, positions = ((1, 2, 4), (1, 2, 4)) if tiny else (BATCHES, POSITIONS)
    context, repeat, depths = (32, 2, (1, 2)) if tiny else (256, 7, (2, 4))
    s7 = shapes(tiny)["llama-2-7b"]
    # The engine on the whole 7B shape (32 layers on a GPU): what a round costs beyond the forwards it runs.
    layers, draft_layers = (2, 1) if tiny else ((s7.layers, 4) if device.type == "cuda" else (4, 2))
    for b in (1, 8) if "engine" in stages else ():
        stage(result, result.setdefault("engine", {}), str(b), out_dir,
              lambda b=b: engine_rounds(s7, dtype, device, layers, draft_layers, b, 16 if tiny else 64))
    result["engine_layers"] = layers
    result["verify"] = {}

    def grid_of(shape: ModelShape) -> dict:
        grid = scaled_grid(shape, dtype, device, depths, context, batches, positions, repeat)
        if "device_row" not in result:
            return {"shape": shape.__dict__, "context": context, "grid": grid}
        measured = Device("measured", memory_gb=0, bandwidth_eff=1.0, flops_eff=1.0,
                          **device_fields(result["device_row"]))
        for b, by_n in grid.items():
            for n, cell in by_n.items():
                cell["roofline_ms"] = round(forward_ms(shape, measured, int(b), int(n), context), 3)
        return {"shape": shape.__dict__, "context": context, "grid": grid}

    for key, shape in shapes(tiny).items() if "verify" in stages else ():
        stage(result, result["verify"], key, out_dir, lambda shape=shape: grid_of(shape))
    (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def summary(res: dict) -> str:
    """The device, its row, the engine's rounds and any stage's error, as JSON."""
    return json.dumps({k: res.get(k) for k in ("device_name", "device_row", "engine", "errors")}, indent=1,
                      default=str) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Without the CLI's settings stack: what scripts/gpu_check.sh runs."""
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="tiny widths: a dry run on CPU")
    p.add_argument("--stages", default="row,engine,verify", help="comma list of " + ", ".join(STAGES))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    res = run(args.out, args.tiny, tuple(args.stages.split(",")))
    print(summary(res), end="")
    return 1 if res.get("errors") else 0


if __name__ == "__main__":
    raise SystemExit(main())
