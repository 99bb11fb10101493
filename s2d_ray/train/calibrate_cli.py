"""`s2d calibrate --target T --draft D`: per-target exits' acceptance and cost -> thresholds + draft-length policy."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from ..build import build_draft, load_profile, load_target, set_threads
from ..commands.engine_args import add_engine_args, engine_config
from ..config import DATA_DIR
from .calibrate import measure_costs, search
from .data import load_examples, pack
from .forward import SubVocab
from .selfdistill import generate_responses, pick_rows
from .validate import path_predictions, summarize

logger = logging.getLogger(__name__)


def register_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="measure each exit's acceptance and cost for a target; write its profile")
    add_engine_args(p)
    p.add_argument("--out", required=True, help="profile JSON to write (pass it later as --calibration)")
    p.add_argument("--data", default=str(DATA_DIR / "train" / "instructions.jsonl"),
                   help="calibration instructions: the held-out split of this file (never Spec-Bench)")
    p.add_argument("--paths", default=None, help="JSONL of the target's greedy responses (made if missing)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--gsm8k-fraction", type=float, default=0.25)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.set_defaults(func=run_calibrate)


def data_relative(path: Path) -> str:
    """A data file as a profile records it: relative to DATA_DIR (no machine's absolute path); outside it, its name."""
    try:
        return str(path.resolve().relative_to(DATA_DIR.resolve()))
    except ValueError:
        return str(path) if not path.is_absolute() else path.name


def run_calibrate(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        raise ValueError("--num-prompts and --max-new-tokens must be >= 1")
    set_threads(args.threads)
    cfg = engine_config(args)
    out = Path(args.out)
    paths = Path(args.paths) if args.paths else out.with_suffix(".paths.jsonl")
    if not paths.exists():
        rows = pick_rows(Path(args.data), args.num_prompts, 0, "heldout", {"gsm8k_train": args.gsm8k_fraction})
        generate_responses(cfg.target.resolved_source, rows, paths, args.max_new_tokens, threads=args.threads)
    target = load_target(cfg)
    draft = build_draft(cfg, target, load_profile(cfg))
    exits = draft.spec.exit_layers
    rows = pack(load_examples([paths], target.tokenizer, "heldout"), 1024)
    if not rows:
        raise ValueError(f"{paths} holds no responses to held-out instructions; calibrate on held-out prompts only")
    vocab = SubVocab(draft.vocab_ids, target.model.config.vocab_size)
    preds = path_predictions(draft.parts, draft.layers, rows, exits, vocab)
    prompt = rows[0].ids[0, :64].tolist()
    costs = measure_costs(draft, target.model, prompt)
    ranked = search(preds, exits, costs, max_k=cfg.spec.max_k)
    best = ranked[0]
    paper = next(r for r in ranked if r["thresholds"] == [0.5] * (len(exits) - 1) + [0.0]
                 and (r["policy"], r["k"]) == ("heuristic", 5))
    profile = {"target": cfg.target.resolved_source, "draft": cfg.draft.source, "exit_layers": exits,
               "thresholds": best["thresholds"], "policy": best["policy"], "k": best["k"],
               "modelled": {"speedup": round(best["speedup"], 4), "mat": round(best["mat"], 4)},
               "measured_with": f"{cfg.target.dtype}, {torch.get_num_threads()} threads",
               "paper_defaults_modelled": {"speedup": round(paper["speedup"], 4), "mat": round(paper["mat"], 4)},
               "on_path": summarize(preds, exits, best["thresholds"]),
               "costs_ms": {"exit_token": [round(1e3 * c, 3) for c in costs.exit_token],
                            "extra_head": round(1e3 * costs.head, 3),
                            "verify": {str(n): round(1e3 * t, 3) for n, t in costs.verify.items()}},
               "calibration_set": {"file": data_relative(Path(args.data)), "split": "heldout", "paths": str(paths),
                                   "responses": len(preds), "tokens": sum(len(p.labels) for p in preds)},
               "top5": [{**r, "speedup": round(r["speedup"], 4), "mat": round(r["mat"], 4)} for r in ranked[:5]]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=2))
    print(json.dumps({k: profile[k] for k in ("exit_layers", "thresholds", "policy", "k", "modelled")}))
    return 0
