"""`s2d bench spec|steps|serve`: Spec-Bench side by side, per-step costs, and load against a running server."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from ..commands.generate import add_spec_args, spec_config
from ..config import DEFAULT_DRAFT, DEFAULT_TARGET, DraftConfig, EngineConfig, TargetConfig
from ..core.types import SamplingParams
from ..errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: spec (Spec-Bench), steps (per-step costs), serve (HTTP load)")
    bench = p.add_subparsers(dest="bench_command", required=True)
    _register_spec(bench)
    _register_steps(bench)
    _register_serve(bench)


def _engine_args(p: argparse.ArgumentParser, multi_target: bool) -> None:
    if multi_target:
        p.add_argument("--target", action="append", default=None,
                       help=f"target (repeatable; one draft serves all); default {DEFAULT_TARGET}")
    else:
        p.add_argument("--target", default=DEFAULT_TARGET, help="target: named source, HF directory or .gguf")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft directory, committed draft name or cut:<model>:<L>")
    add_spec_args(p)
    p.add_argument("--calibration", default="auto",
                   help="per-target profile; auto: the one committed with the draft; off: the draft's own settings")
    p.add_argument("--exits", type=_ints, default=None, help="override the draft's exits, e.g. 2,4,6")
    p.add_argument("--thresholds", type=_floats, default=None, help="override thresholds, e.g. 0.5,0.5,0")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


def engine_config(args: argparse.Namespace, target: str) -> EngineConfig:
    return EngineConfig(
        target=TargetConfig(name=target, dtype=args.dtype, calibration=args.calibration),
        draft=DraftConfig(source=args.draft, exit_layers=args.exits, thresholds=args.thresholds),
        spec=spec_config(args, "s2d"),
        num_threads=args.threads,
    )


def _default_out(kind: str) -> Path:
    return Path("bench_results") / f"{kind}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


# --- spec ------------------------------------------------------------------------------------------------------------
def _register_spec(bench) -> None:
    p = bench.add_parser("spec", help="Spec-Bench: every method side by side on the same prompts")
    _engine_args(p, multi_target=True)
    p.add_argument("--questions", type=Path, default=None, help="Spec-Bench question.jsonl "
                   "(default ../shared/data/spec_bench/question.jsonl)")
    p.add_argument("--categories", type=_strs, default=None,
                   help="comma list of tasks (mt_bench,translation,summarization,qa,math_reasoning,rag); default all")
    p.add_argument("--per-category", type=int, default=None, help="questions per category (default: all)")
    p.add_argument("--methods", type=_strs, default=None, help="comma list; default: hf-generate,ar,hf-assisted,"
                   "hf-assisted:heuristic,hf-early-exit:<deepest>,hf-prompt-lookup,exit:<each exit>,s2d")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs checked for equality)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    p.add_argument("--warmup-tokens", type=int, default=16, help="tokens per method in the untimed warm-up")
    p.add_argument("--tie-tolerance", type=float, default=0.01,
                   help="a greedy mismatch whose two tokens' target logits differ by less than this (plus 4 ulps of "
                   "the logit in 16-bit dtypes) is a rounding near-tie")
    p.add_argument("--out", type=Path, default=None, help="output directory (default bench_results/spec-<time>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_spec)


def run_spec(args: argparse.Namespace) -> int:
    from ..build import build_draft, load_target, set_threads
    from .machine import load_average, machine_info
    from .methods import default_method_names, make_methods
    from .report import markdown_tables, write_outputs
    from .spec import SpecRun, default_questions_path, read_questions, run_target, select_questions

    if args.max_new_tokens < 1 or (args.per_category is not None and args.per_category < 1):
        raise ConfigError("--max-new-tokens and --per-category must be >= 1")
    if args.target and len(set(args.target)) != len(args.target):
        raise ConfigError(f"--target repeats a target: {args.target}")
    questions = select_questions(read_questions(args.questions or default_questions_path()),
                                 args.per_category, args.categories)
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed if args.temperature > 0 else None)
    run = SpecRun(args.max_new_tokens, params, args.warmup_tokens, args.tie_tolerance, not args.no_progress)
    out = args.out or _default_out("spec")
    meta = {"targets": args.target or [DEFAULT_TARGET], "draft": args.draft,
            "max_new_tokens": args.max_new_tokens, "sampling": asdict(params),
            "questions": [q.question_id for q in questions], "per_category": args.per_category}
    set_threads(args.threads)  # before machine_info() records the thread count
    meta["machine"] = machine_info()
    records: list[dict] = []
    for name in args.target or [DEFAULT_TARGET]:
        cfg = engine_config(args, name)
        target = load_target(cfg)
        names = args.methods or default_method_names(build_draft(cfg, target).spec.exit_layers)
        methods = make_methods(names, cfg, target)
        meta.setdefault("methods", {})[name] = [m.name for m in methods]
        records += run_target(name, target, methods, questions, run)
    meta["load_average_end"] = load_average()
    sys.stdout.write(markdown_tables(write_outputs(out, meta, records)))
    sys.stdout.write(f"\nwrote {out}/results.json, tables.md, speedup.png, exit_usage.png\n")
    return 0


# --- steps -----------------------------------------------------------------------------------------------------------
def _register_steps(bench) -> None:
    p = bench.add_parser("steps", help="per-step costs: target step, draft exits, verify k, ar vs generate, overhead")
    _engine_args(p, multi_target=False)
    p.add_argument("--context", type=int, default=256, help="context length (tokens) the steps run at")
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions per measurement (median reported)")
    p.add_argument("--max-k", type=int, default=8, help="verify k = 1..max-k draft tokens")
    p.add_argument("--gen-tokens", type=int, default=64, help="tokens per generation in ar-vs-generate and overhead")
    p.add_argument("--gen-prompts", type=int, default=3, help="prompts in ar-vs-generate and the overhead runs")
    p.add_argument("--questions", type=Path, default=None, help="Spec-Bench question.jsonl for real prompts")
    p.add_argument("--out", type=Path, default=None, help="output directory (default bench_results/steps-<time>)")
    p.set_defaults(func=run_steps)


def run_steps(args: argparse.Namespace) -> int:
    from .steps import StepsRun, run_all, steps_markdown

    if min(args.context, args.repeats, args.max_k, args.gen_tokens, args.gen_prompts) < 1:
        raise ConfigError("--context, --repeats, --max-k, --gen-tokens and --gen-prompts must be >= 1")
    cfg = engine_config(args, args.target)
    result = run_all(cfg, StepsRun(args.context, args.repeats, args.max_k, args.gen_tokens, args.gen_prompts,
                                   args.questions))
    out = args.out or _default_out("steps")
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps.json").write_text(json.dumps(result, indent=1))
    text = steps_markdown(result)
    (out / "steps.md").write_text(text)
    sys.stdout.write(text + f"\nwrote {out}/steps.json, steps.md\n")
    return 0


# --- serve -----------------------------------------------------------------------------------------------------------
def _register_serve(bench) -> None:
    p = bench.add_parser("serve", help="bounded streaming load against an OpenAI-compatible server")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (/v1/completions is appended)")
    p.add_argument("--model", default=DEFAULT_TARGET, help="the `model` field of each request")
    p.add_argument("--concurrency", type=_ints, default=[1, 2, 4, 8, 16], help="levels, e.g. 1,2,4,8,16")
    p.add_argument("--requests", type=int, default=16, help="requests per level (at least the concurrency)")
    p.add_argument("--max-seconds", type=float, default=120.0, help="time limit per level; then it stops")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout (seconds)")
    p.add_argument("--questions", type=Path, default=None, help="Spec-Bench question.jsonl for the mixed prompts")
    p.add_argument("--no-usage", action="store_true", help="do not ask for stream_options.include_usage")
    p.add_argument("--api-key-env", default="S2D_API_KEY", help="environment variable holding the bearer key")
    p.add_argument("--out", type=Path, default=None, help="output directory (default bench_results/serve-<time>)")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import asyncio

    from .serve import LoadRun, mixed_prompts, run_load, serve_markdown, plot_load

    if args.requests < 1 or args.max_tokens < 1 or args.max_seconds <= 0 or min(args.concurrency) < 1:
        raise ConfigError("--requests, --max-tokens, --max-seconds and --concurrency must be positive")
    load = LoadRun(args.url, args.model, args.concurrency, args.requests, args.max_seconds, args.max_tokens,
                   args.temperature, args.timeout, not args.no_usage, os.environ.get(args.api_key_env) or None)
    result = asyncio.run(run_load(load, mixed_prompts(args.questions)))
    out = args.out or _default_out("serve")
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps(result, indent=1))
    text = serve_markdown(result)
    (out / "serve.md").write_text(text)
    plot_load(result, out / "serve.png")
    sys.stdout.write(text + f"\nwrote {out}/serve.json, serve.md, serve.png\n")
    return 1 if result["summary"] and all(lv["completed"] == 0 for lv in result["summary"]) else 0


# --- argument types --------------------------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _strs(text: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list")
    return items
