"""`s2d calibrate --target T --draft D`: per-target exits' acceptance and cost -> thresholds + draft-length policy."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

import torch

from ..build import build_draft, default_device, load_profile, load_target, set_threads
from ..commands.engine_args import add_engine_args, engine_config
from ..config import DATA_DIR, SPEC_BENCH_QUESTIONS, TRAIN_DATA, data_file, optional_data_file
from ..hardware import for_machine, machine_name, store_costs
from ..prompts import sample_prompts
from .calibrate import (DRAFT_ROW_BATCH, GRID_BATCHES, GRID_POSITIONS, Costs, context_ids, fixed_exits,
                        measure_costs, search)
from .data import load_examples, pack
from .forward import SubVocab
from .selfdistill import generate_responses, pick_rows
from .validate import path_predictions, summarize

logger = logging.getLogger(__name__)


def register_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="measure each exit's acceptance and cost for a target; write its profile")
    add_engine_args(p)
    p.add_argument("--out", default=None, help="profile JSON to write (pass it later as --calibration)")
    p.add_argument("--costs-only", action="store_true",
                   help="re-measure only the costs of an existing --profile (its target, draft and dtype); keep its "
                        "acceptance and chosen settings")
    p.add_argument("--profile", default=None, help="with --costs-only: the profile to refresh in place")
    p.add_argument("--costs-from", default=None, metavar="PROFILE",
                   help="take the costs (every machine's) from this profile of the same target, dtype and exits "
                        "instead of measuring them: a retrained draft of the same shape costs the same")
    p.add_argument("--context", type=int, default=256, help="tokens of KV prefilled before costs are timed")
    p.add_argument("--repeats", type=int, default=7, help="timed repetitions per cost (the median is kept)")
    p.add_argument("--data", default=None, help="calibration instructions: the held-out split of this file (never "
                   "Spec-Bench); default $S2D_DATA_DIR/train/instructions.jsonl (read only when --paths is missing)")
    p.add_argument("--paths", default=None, help="JSONL of the target's greedy responses (made if missing)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--gsm8k-fraction", type=float, default=0.25)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.set_defaults(func=run_calibrate)


def data_relative(path: Path) -> str:
    """A data file as a profile records it: relative to DATA_DIR (no machine's absolute path); outside it, its name."""
    try:
        if DATA_DIR is not None:
            return str(path.resolve().relative_to(DATA_DIR.resolve()))
    except ValueError:
        pass
    return str(path) if not path.is_absolute() else path.name


def cost_context(tokenizer, length: int) -> list[int]:
    """`length` tokens of chat-templated questions (Spec-Bench's where the data directory has them, else synthetic
    text): costs depend on the context length, not on the tokens."""
    return context_ids(sample_prompts(tokenizer, optional_data_file(SPEC_BENCH_QUESTIONS), 3), length)


def measure_profile_costs(cfg, args: argparse.Namespace, target=None, draft=None) -> tuple[Costs, dict]:
    """Costs, and the profile fields that record them (`costs_ms`, how measured), for this config's target, draft
    and dtype."""
    target = target or load_target(cfg)
    draft = draft or build_draft(cfg, target, load_profile(cfg))
    costs = measure_costs(draft, target.model, cost_context(target.tokenizer, args.context), repeat=args.repeats)
    return costs, {"costs_ms": costs.to_profile(), "dtype": cfg.target.dtype,
                       "costs_measured": {"context": args.context, "repeats": args.repeats, "statistic": "median",
                                      "batches": list(GRID_BATCHES), "positions": list(GRID_POSITIONS),
                                      "draft_row_batch": DRAFT_ROW_BATCH, "load_average": list(os.getloadavg()),
                                      "threads": torch.get_num_threads(), "wide_threads": cfg.wide_threads,
                                      "machine": machine_name(next(target.model.parameters()).device.type)}}


def borrowed_costs(path: str, cfg, exits: list[int]) -> tuple[Costs, dict]:
    """The costs of another profile of this target, dtype and exits (this machine's where it carries them), and its
    cost fields to copy: costs depend on the draft's shape, not on its weights."""
    try:
        source = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--costs-from {path}: not a readable profile ({exc})") from exc
    want = {"target": cfg.target.resolved_source, "dtype": cfg.target.dtype, "exit_layers": exits}
    have = {k: source.get(k) for k in want}
    if have != want or not source.get("costs_ms"):
        raise ValueError(f"--costs-from {path} holds costs for {have}, this calibration is for {want}")
    here = for_machine(source, machine_name(default_device().type), path)
    fields = {k: source[k] for k in ("costs_ms", "costs_measured", "costs_by_machine") if k in source}
    return Costs.from_profile(here["costs_ms"]), {**fields, "dtype": want["dtype"], "costs_from": path}


def refresh_costs(args: argparse.Namespace) -> int:
    """Re-measure an existing profile's costs only (acceptance takes long and does not depend on the machine)."""
    if not args.profile:
        raise ValueError("--costs-only needs --profile PATH")
    path = Path(args.profile)
    if not path.is_file():
        raise ValueError(f"profile {path} does not exist")
    profile = json.loads(path.read_text())
    dtype = profile.get("dtype") or profile.get("measured_with", "float32").split(",")[0]
    args.target, args.draft, args.dtype, args.calibration = profile["target"], profile["draft"], dtype, "off"
    fields = measure_profile_costs(engine_config(args), args)[1]
    profile = store_costs(profile, fields["costs_ms"], fields["costs_measured"])  # beside another machine's costs
    profile["dtype"] = fields["dtype"]
    out = Path(args.out) if args.out else path
    out.write_text(json.dumps(profile, indent=2))
    print(json.dumps({"profile": str(out), "machine": fields["costs_measured"]["machine"],
                      "costs_ms": fields["costs_ms"]}))
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    if min(args.num_prompts, args.max_new_tokens, args.context, args.repeats) < 1:
        raise ValueError("--num-prompts, --max-new-tokens, --context and --repeats must be >= 1")
    set_threads(args.threads)
    if args.costs_only:
        return refresh_costs(args)
    if not args.out:
        raise ValueError("calibrate needs --out PATH (or --costs-only --profile PATH)")
    cfg = engine_config(args)
    out = Path(args.out)
    paths = Path(args.paths) if args.paths else out.with_suffix(".paths.jsonl")
    if not paths.exists():
        data = Path(args.data) if args.data else data_file(TRAIN_DATA, "--data (or --paths)")
        rows = pick_rows(data, args.num_prompts, 0, "heldout", {"gsm8k_train": args.gsm8k_fraction})
        generate_responses(cfg.target.resolved_source, rows, paths, args.max_new_tokens, threads=args.threads)
    target = load_target(cfg)
    draft = build_draft(cfg, target, load_profile(cfg))
    exits = draft.spec.exit_layers
    rows = pack(load_examples([paths], target.tokenizer, "heldout"), 1024)
    if not rows:
        raise ValueError(f"{paths} holds no responses to held-out instructions; calibrate on held-out prompts only")
    vocab = SubVocab(draft.vocab_ids, target.model.config.vocab_size)
    preds = path_predictions(draft.parts, draft.layers, rows, exits, vocab)
    if args.costs_from:
        costs, measured = borrowed_costs(args.costs_from, cfg, exits)
    else:
        costs, measured = measure_profile_costs(cfg, args, target, draft)
    ranked = search(preds, exits, costs, max_k=cfg.spec.max_k)
    alone = fixed_exits(preds, exits, costs, max_k=cfg.spec.max_k)
    best = ranked[0]
    paper = next(r for r in ranked if r["thresholds"] == [0.5] * (len(exits) - 1) + [0.0]
                 and (r["policy"], r["k"]) == ("heuristic", 5))
    profile = {"target": cfg.target.resolved_source, "draft": cfg.draft.source, "exit_layers": exits,
               "thresholds": best["thresholds"], "policy": best["policy"], "k": best["k"],
               "modelled": {"speedup": round(best["speedup"], 4), "mat": round(best["mat"], 4)},
               "paper_defaults_modelled": {"speedup": round(paper["speedup"], 4), "mat": round(paper["mat"], 4)},
               "fixed_exits_modelled": alone,
               "on_path": summarize(preds, exits, best["thresholds"]),
               **measured,
               "calibration_set": {"file": data_relative(Path(args.data)) if args.data else TRAIN_DATA,
                                   "split": "heldout", "paths": str(paths),
                                   "responses": len(preds), "tokens": sum(len(p.labels) for p in preds)},
               "top5": [{**r, "speedup": round(r["speedup"], 4), "mat": round(r["mat"], 4)} for r in ranked[:5]]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=2))
    print(json.dumps({**{k: profile[k] for k in ("exit_layers", "thresholds", "policy", "k", "modelled",
                                                 "fixed_exits_modelled")},
                      "topk_hit": profile["on_path"].get("topk_hit")}))
    return 0
