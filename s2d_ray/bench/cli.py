"""`s2d bench spec|steps|plan-check|serve|draft-capacity|gpu-check|gpu-profile|gpu-serve`: Spec-Bench side by side,
per-step costs, the fleet model checked, load against a running server, the shared draft's capacity under that load,
and the prepared GPU measurements (the served app on one GPU among them)."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path

from ..commands.engine_args import INTS, NAMES, add_engine_args, engine_config
from ..config import DEFAULT_DRAFT, DEFAULT_TARGET
from ..core.types import SamplingParams
from ..errors import ConfigError
from .lora import register as register_lora
from .lora_serve import register as register_lora_serve
from .structured import register as register_structured


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: spec (Spec-Bench), steps (per-step costs), plan-check, serve (HTTP "
                       "load), draft-capacity (the shared draft under that load), exits (when deeper exits pay), "
                       "lora and lora-serve (adapters on one base vs merged targets, in process and served), gpu-check "
                       "and gpu-profile (on a GPU)")
    bench = p.add_subparsers(dest="bench_command", required=True)
    _register_spec(bench)
    _register_steps(bench)
    _register_plan_check(bench)
    _register_exits(bench)
    _register_serve(bench)
    _register_draft_capacity(bench)
    _register_gpu(bench)
    _register_cluster(bench)
    register_structured(bench)
    register_lora(bench)
    register_lora_serve(bench)


def _default_out(kind: str) -> Path:
    return Path("bench_results") / f"{kind}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


# --- spec ------------------------------------------------------------------------------------------------------------
def _register_spec(bench) -> None:
    p = bench.add_parser("spec", help="Spec-Bench: every method side by side on the same prompts")
    add_engine_args(p, multi_target=True, mode=False)
    p.add_argument("--questions", type=Path, default=None, help="Spec-Bench question.jsonl "
                   "(default $S2D_DATA_DIR/spec_bench/question.jsonl)")
    p.add_argument("--categories", type=NAMES, default=None,
                   help="comma list of tasks (mt_bench,translation,summarization,qa,math_reasoning,rag); default all")
    p.add_argument("--per-category", type=int, default=None, help="questions per category (default: all)")
    p.add_argument("--methods", type=NAMES, default=None, help="comma list; default: hf-generate,ar,hf-assisted,"
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
    p.add_argument("--busy-neighbour", action="store_true",
                   help="also run every method beside a CPU-bound process on one core (`<method>+busy`), alone and "
                   "beside interleaved per question")
    p.add_argument("--out", type=Path, default=None, help="output directory (default bench_results/spec-<time>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_spec)


def run_spec(args: argparse.Namespace) -> int:
    from ..build import build_draft, load_profile, load_target, set_threads
    from ..hardware import load_average, machine_info
    from .methods import default_method_names, make_methods
    from .neighbour import BesideNeighbour, BusyNeighbour
    from .report import markdown_tables, write_outputs
    from ..prompts import read_questions, select_questions
    from .spec import SpecRun, default_questions_path, run_target

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
    meta["busy_neighbour"] = args.busy_neighbour
    with BusyNeighbour() if args.busy_neighbour else contextlib.nullcontext() as neighbour:
        for name in args.target or [DEFAULT_TARGET]:
            cfg = engine_config(args, name, "s2d")
            target = load_target(cfg)
            names = args.methods or default_method_names(build_draft(cfg, target, load_profile(cfg)).spec.exit_layers)
            methods = make_methods(names, cfg, target)
            if neighbour is not None:
                methods += [BesideNeighbour(m, neighbour) for m in methods]
            meta.setdefault("methods", {})[name] = [m.name for m in methods]
            records += run_target(name, target, methods, questions, run)
    meta["load_average_end"] = load_average()
    sys.stdout.write(markdown_tables(write_outputs(out, meta, records)))
    sys.stdout.write(f"\nwrote {out}/results.json, tables.md, speedup.png, exit_usage.png\n")
    return 0


# --- steps -----------------------------------------------------------------------------------------------------------
def _register_steps(bench) -> None:
    p = bench.add_parser("steps", help="per-step costs: target step, draft exits, verify k, ar vs generate, overhead")
    add_engine_args(p, mode=False)
    p.add_argument("--context", type=int, default=256, help="context length (tokens) the steps run at")
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions per measurement (median reported)")
    p.add_argument("--max-k", type=int, default=8, help="verify k = 1..max-k draft tokens")
    p.add_argument("--gen-tokens", type=int, default=64, help="tokens per generation in ar-vs-generate and overhead")
    p.add_argument("--gen-prompts", type=int, default=3, help="prompts in ar-vs-generate and the overhead runs")
    p.add_argument("--questions", type=Path, default=None, help="Spec-Bench question.jsonl for real prompts "
                   "(default $S2D_DATA_DIR/spec_bench/question.jsonl if it exists, else synthetic prompts)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default bench_results/steps-<time>)")
    p.set_defaults(func=run_steps)


def run_steps(args: argparse.Namespace) -> int:
    from .steps import StepsRun, run_all, steps_markdown

    if min(args.context, args.repeats, args.max_k, args.gen_tokens, args.gen_prompts) < 1:
        raise ConfigError("--context, --repeats, --max-k, --gen-tokens and --gen-prompts must be >= 1")
    cfg = engine_config(args, args.target, "s2d")
    result = run_all(cfg, StepsRun(args.context, args.repeats, args.max_k, args.gen_tokens, args.gen_prompts,
                                   args.questions))
    return _write_report(args.out or _default_out("steps"), "steps", result, steps_markdown(result))


def _write_report(out: Path, stem: str, result: dict, text: str) -> int:
    """<out>/<stem>.json and .md, and the table on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(text)
    sys.stdout.write(text + f"\nwrote {out}/{stem}.json, {stem}.md\n")
    return 0


# --- plan-check ------------------------------------------------------------------------------------------------------
def _register_plan_check(bench) -> None:
    p = bench.add_parser("plan-check", help="the fleet model's predicted ar/s2d tok/s on this CPU against measured")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads (the hardware row is measured at this)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per sequence")
    p.add_argument("--batches", type=INTS, default=[1, 8], help="batch sizes, e.g. 1,8")
    p.add_argument("--repeats", type=int, default=3, help="runs per (mode, batch); the median tok/s is kept")
    p.add_argument("--quick", action="store_true", help="small device measurements (tests)")
    p.add_argument("--prompts", choices=["heldout", "specbench"], default="heldout",
                   help="held-out instructions (the profile's own distribution) or Spec-Bench questions")
    p.add_argument("--data", type=Path, default=None, help="the --prompts file: instructions (default "
                   "$S2D_DATA_DIR/train/instructions.jsonl) or Spec-Bench questions (default "
                   "$S2D_DATA_DIR/spec_bench/question.jsonl)")
    p.add_argument("--gpu-json", type=Path, default=None,
                   help="instead: the model against a GPU run's own rounds (a gpu_check.json of scripts/gpu_check.sh)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default bench_results/plan-check-<time>)")
    p.set_defaults(func=run_plan_check)


def run_plan_check(args: argparse.Namespace) -> int:
    from .plan_check import PlanCheck, check_markdown, gpu_errors, gpu_markdown, run_check

    if args.gpu_json is not None:
        if not args.gpu_json.is_file():
            raise ConfigError(f"--gpu-json {args.gpu_json}: no such file")
        result = json.loads(args.gpu_json.read_text())
        if "device_row" not in result or "engine" not in result:
            raise ConfigError(f"--gpu-json {args.gpu_json}: not a gpu_check.json with a device row and engine rounds")
        print(gpu_markdown(result, gpu_errors(result)), end="")
        return 0
    if min(args.threads, args.tokens, args.repeats, *args.batches) < 1:
        raise ConfigError("--threads, --tokens, --repeats and --batches must be >= 1")
    result = run_check(PlanCheck(args.target, args.draft, args.dtype, args.threads, args.tokens,
                                 tuple(args.batches), args.repeats, args.quick, args.prompts,
                                 str(args.data) if args.data else None))
    return _write_report(args.out or _default_out("plan-check"), "plan_check", result, check_markdown(result))


# --- exits -----------------------------------------------------------------------------------------------------------
def _register_exits(bench) -> None:
    from ..fleet.hardware import DEVICES
    from .exits import PROFILES

    p = bench.add_parser("exits", help="when a sorted draft's deeper exits pay: each exit alone, modelled from its "
                         "measured agreement and each machine's costs (CPU profiles; GPUs through the fleet model)")
    p.add_argument("--profiles", type=Path, default=PROFILES,
                   help="calibration profiles (default: the committed draft's): CPU rows, one per machine they carry")
    p.add_argument("--config", type=Path, default=Path("deployments/gpu.yaml"),
                   help="Serve YAML whose targets and draft the GPU rows model (none: CPU rows only)")
    p.add_argument("--devices", type=NAMES, default=["h100", "l40s"], help=f"GPUs to model ({', '.join(DEVICES)})")
    p.add_argument("--agree-from", type=Path, default=None,
                   help="profile whose per-exit agreement the GPU rows take (default: the instruct bf16 profile)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default bench_results/exits-<time>)")
    p.set_defaults(func=run_exits)


def run_exits(args: argparse.Namespace) -> int:
    from ..fleet.hardware import device
    from .exits import cpu_tables, gpu_tables, markdown

    if not args.profiles.is_dir() or not any(args.profiles.glob("*.json")):
        raise ConfigError(f"--profiles {args.profiles}: no calibration profiles (*.json) there")
    tables = cpu_tables(args.profiles)
    if str(args.config) != "none":
        if not args.config.is_file():
            raise ConfigError(f"--config {args.config}: no such file (none: CPU rows only)")
        agree_from = args.agree_from or args.profiles / "smollm2-135m-instruct.bfloat16.json"
        if not agree_from.is_file():
            raise ConfigError(f"--agree-from {agree_from}: no such profile")
        for name in args.devices:
            tables += gpu_tables(args.config, device(name), agree_from)
    return _write_report(args.out or _default_out("exits"), "exits", {"tables": tables}, markdown(tables))


# --- serve -----------------------------------------------------------------------------------------------------------
def _register_serve(bench) -> None:
    p = bench.add_parser("serve", help="bounded streaming load against an OpenAI-compatible server")
    p.add_argument("--model", default=DEFAULT_TARGET, help="the `model` field of each request")
    _add_load_args(p, "levels, e.g. 1,2,4,8,16", [1, 2, 4, 8, 16], "requests per level (at least the concurrency)")
    p.add_argument("--compare-plain", action="store_true",
                   help="each level also runs with speculate: false (plain decoding through the same app): served "
                   "speculative vs served AR in one run")
    p.add_argument("--check-greedy", action="store_true",
                   help="ask for each response's token ids and compare them with in-process greedy decoding of the "
                   "same prompt (this machine's engine, --mode ar, the target --model names, --check-dtype); needs "
                   "--temperature 0; exit status 1 when a difference is not a rounding near-tie (any, in fp32)")
    p.add_argument("--check-dtype", default="auto",
                   help="dtype of the in-process reference: the served target's (auto resolves as the server does)")
    p.add_argument("--check-batch", type=int, default=8, help="prompts the reference decodes together")
    p.add_argument("--warmup", type=int, default=4, help="requests sent first, one after another (per variant, the "
                   "first prompts), and not counted: a fresh server's first few requests pay one-time costs")
    p.add_argument("--twin", type=Path, default=None, metavar="YAML",
                   help="the served app's Serve YAML: after the levels, build its engine for --model in this process "
                   "and alternate served and in-process runs of the same requests at --twin-concurrency (--twin-pairs "
                   "times per variant): served / in-process, each pair minutes apart")
    p.add_argument("--twin-pairs", type=int, default=3, help="served / in-process pairs per variant with --twin")
    p.add_argument("--twin-concurrency", type=INTS, default=[1], help="comma list: the concurrencies the --twin "
                   "pairs run at (each pair's twin decodes with as many closed-loop clients)")
    p.add_argument("--workload", choices=["mixed", "shared-prefix", "repeated", "mt-bench"], default="mixed",
                   help="prompts: the mixed ones; each after one ~700-token system prompt; or the first --requests / 2 "
                   "mixed prompts twice (a level's second half repeats its first; see docs/CACHING.md); or MT-Bench's "
                   "two-turn chats, turn 2 carrying turn 1's answer, its TTFT reported apart (a request = a chat)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default bench_results/serve-<time>)")
    p.set_defaults(func=run_serve)


def _register_draft_capacity(bench) -> None:
    p = bench.add_parser("draft-capacity", help="load 1, 2, ... targets of one served app at rising concurrency and "
                         "report the shared draft replica's busy fraction, merging and queueing delay")
    p.add_argument("--targets", type=NAMES, required=True, help="comma list of served target names, loaded 1, 2, "
                   "... at a time in this order")
    _add_load_args(p, "streams PER TARGET, e.g. 1,2,4", [1, 2, 4], "requests per target per level")
    p.add_argument("--out", type=Path, default=None,
                   help="output directory (default bench_results/draft-capacity-<time>)")
    p.set_defaults(func=run_draft_capacity)


def _add_load_args(p, concurrency_help: str, concurrency: list[int], requests_help: str) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (/v1/completions is appended)")
    p.add_argument("--concurrency", type=INTS, default=concurrency, help=concurrency_help)
    p.add_argument("--requests", type=int, default=16, help=requests_help)
    p.add_argument("--max-seconds", type=float, default=120.0, help="time limit per level; then it stops")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout (seconds)")
    p.add_argument("--questions", type=Path, default=None, help="Spec-Bench question.jsonl for the mixed prompts "
                   "(default $S2D_DATA_DIR/spec_bench/question.jsonl if it exists, else four built-in prompts)")
    p.add_argument("--no-usage", action="store_true", help="do not ask for stream_options.include_usage")
    p.add_argument("--api-key-env", default="S2D_API_KEY", help="environment variable holding the bearer key")


def _load_run(args: argparse.Namespace, model: str):
    from .serve import LoadRun

    if args.requests < 1 or args.max_tokens < 1 or args.max_seconds <= 0 or min(args.concurrency) < 1:
        raise ConfigError("--requests, --max-tokens, --max-seconds and --concurrency must be positive")
    return LoadRun(args.url, model, args.concurrency, args.requests, args.max_seconds, args.max_tokens,
                   args.temperature, args.timeout, not args.no_usage, os.environ.get(args.api_key_env) or None,
                   compare_plain=getattr(args, "compare_plain", False))


def run_serve(args: argparse.Namespace) -> int:
    import asyncio

    from .serve import mixed_prompts, run_load, workload_prompts
    from .serve_report import plot_load, serve_markdown

    if args.check_greedy and (args.temperature != 0.0 or args.check_batch < 1):
        raise ConfigError("--check-greedy needs --temperature 0 and --check-batch >= 1")
    if args.warmup < 0:
        raise ConfigError("--warmup must be >= 0")
    if args.twin_pairs < 1:
        raise ConfigError("--twin-pairs must be >= 1")
    if any(c < 1 for c in args.twin_concurrency):
        raise ConfigError("--twin-concurrency: every level must be >= 1")
    load = replace(_load_run(args, args.model), return_token_ids=args.check_greedy, warmup=args.warmup,
                   workload=args.workload,
                   twin_pairs=args.twin_pairs if args.twin else 0, twin_concurrency=tuple(args.twin_concurrency))
    prompts = workload_prompts(args.workload, mixed_prompts(args.questions), args.requests)
    twin = None
    if args.twin:  # built first: a config that cannot make the twin fails before the load runs
        from ..fleet.plan import read_app_config
        from .twin import build_twin

        twin = build_twin(read_app_config(args.twin), args.model, prompts)
    result = asyncio.run(run_load(load, prompts, twin))
    markdown = serve_markdown(result)
    if args.check_greedy:
        from ..config import EngineConfig, TargetConfig
        from .greedy_check import GreedyCheck, check_greedy, greedy_markdown

        engine = EngineConfig(target=TargetConfig(name=args.model, dtype=args.check_dtype), num_threads=1)
        result["greedy_check"] = check_greedy(result, prompts, GreedyCheck(engine, batch=args.check_batch))
        markdown += "\n" + greedy_markdown(result["greedy_check"])
    out = args.out or _default_out("serve")
    _write_report(out, "serve", result, markdown)
    plot_load(result, out / "serve.png")
    if "greedy_check" in result and not result["greedy_check"]["passed"]:
        return 1
    return 1 if result["summary"] and all(lv["completed"] == 0 for lv in result["summary"]) else 0


def run_draft_capacity(args: argparse.Namespace) -> int:
    import asyncio

    from .draft_capacity import CapacityRun, capacity_markdown, plot_capacity, run_capacity
    from .serve import mixed_prompts

    if len(set(args.targets)) != len(args.targets):
        raise ConfigError(f"--targets repeats a target: {args.targets}")
    run = CapacityRun(_load_run(args, args.targets[0]), args.targets)
    result = asyncio.run(run_capacity(run, mixed_prompts(args.questions)))
    out = args.out or _default_out("draft-capacity")
    _write_report(out, "draft_capacity", result, capacity_markdown(result))
    plot_capacity(result, out / "draft_capacity.png")
    return 1 if all(lv["completed"] == 0 for lv in result["levels"]) else 0


# --- gpu-check, gpu-profile ------------------------------------------------------------------------------------------
def _register_gpu(bench) -> None:
    p = bench.add_parser("gpu-check", help="on a GPU: the fleet model's device row, the engine's rounds on a 7B shape "
                         "and verify grids of 7B/13B/70B-TP4-rank shapes (random bf16 weights, nothing downloaded)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default bench_results/gpu-check-<time>)")
    p.add_argument("--tiny", action="store_true", help="tiny widths: the same code path as a dry run on a CPU")
    p.add_argument("--stages", type=NAMES, default=None, help="comma list of row, engine, verify (default: all)")
    p.set_defaults(func=run_gpu_check)
    p = bench.add_parser("gpu-profile", help="on a GPU: where a decode step's time goes (transformers' step, the "
                         "verifier's, the engine's round, a profile of its rounds, transformers generate)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default bench_results/gpu-profile-<time>)")
    p.add_argument("--tiny", action="store_true", help="tiny widths: the same code path as a dry run on a CPU")
    p.add_argument("--compile", action="store_true", help="also transformers' static cache, compiled (minutes)")
    p.set_defaults(func=run_gpu_profile)
    p = bench.add_parser("gpu-serve", help="on one GPU: the Serve app (router on the CPU, a random 7B-shaped target "
                         "and a draft cut from it on the GPU) under OpenAI load; S2D == AR in float32, tok/s and TTFT "
                         "in bfloat16 per concurrency")
    p.add_argument("--out", type=Path, default=None, help="output directory (default bench_results/gpu-serve-<time>)")
    p.add_argument("--tiny", action="store_true", help="small shapes on the CPU: the same app as a dry run")
    p.add_argument("--concurrency", type=INTS, default=None, help="comma list (default 1,2,4,8,16,32; --tiny 1,4)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 64; --tiny 12)")
    p.add_argument("--requests", type=int, default=None, help="requests per level and variant (default 32)")
    p.add_argument("--port", type=int, default=8000, help="Serve's HTTP port on 127.0.0.1")
    p.set_defaults(func=run_gpu_serve)


def run_gpu_check(args: argparse.Namespace) -> int:
    from .gpu_check import STAGES, run, summary

    stages = tuple(args.stages or STAGES)
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        raise ConfigError(f"--stages: unknown {unknown}; choose from {', '.join(STAGES)}")
    res = run(args.out or _default_out("gpu-check"), args.tiny, stages)
    sys.stdout.write(summary(res))
    return 1 if res.get("errors") else 0


def run_gpu_serve(args: argparse.Namespace) -> int:
    from .gpu_serve import GpuServe, failures, markdown, require_gpu, run, tiny_run

    require_gpu(args.tiny)  # before anything starts: one line where there is no GPU
    out = args.out or _default_out("gpu-serve")
    cfg = tiny_run(out, args.port) if args.tiny else GpuServe(out=out, port=args.port)
    given = {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "requests": args.requests}
    cfg = replace(cfg, **{k: v for k, v in given.items() if v is not None})
    result = run(cfg)
    sys.stdout.write(markdown(result))
    bad = failures(result)
    for line in bad:
        print(f"FAIL {line}", file=sys.stderr)
    return 1 if bad else 0


def run_gpu_profile(args: argparse.Namespace) -> int:
    from .gpu_profile import run, summary

    sys.stdout.write(summary(run(args.out or _default_out("gpu-profile"), args.tiny, args.compile)))
    return 0


# --- autoscale, cross-node -------------------------------------------------------------------------------------------
def _register_cluster(bench) -> None:
    p = bench.add_parser("autoscale", help="Ray's autoscaler on this machine with node types derived from "
                         "cluster.yaml: Serve scales a target under load, nodes come and go; times recorded")
    p.add_argument("--out", type=Path, default=None, help="output directory (default bench_results/autoscale-<time>)")
    p.add_argument("--cluster", type=Path, default=Path("cluster.yaml"), help="the `ray up` cluster config")
    p.add_argument("--node-type", default="gpu_small", help="worker node type the target's replicas ask for")
    p.add_argument("--max-devices", type=int, default=1,
                   help="custom resources per derived node at most (1: every replica of the target needs a node)")
    p.add_argument("--idle-timeout-s", type=float, default=5.0, help="the autoscaler's idle timeout on this machine")
    p.add_argument("--concurrency", type=int, default=4, help="client threads during the load")
    p.add_argument("--phase-timeout-s", type=float, default=120.0, help="bound on each wait (node up, replica, ...)")
    p.set_defaults(func=run_autoscale)
    p = bench.add_parser("cross-node", help="a speculative round's cost with the draft and the target on other nodes "
                         "than the router against all on one node (three raylets on this machine)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default bench_results/cross-node-<time>)")
    p.add_argument("--reps", type=int, default=5, help="alternations between the two placements")
    p.add_argument("--requests", type=int, default=4, help="single-stream requests per rep and placement")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    p.add_argument("--k", type=int, default=4, help="draft tokens per round (fixed policy)")
    p.set_defaults(func=run_cross_node)


def run_autoscale(args: argparse.Namespace) -> int:
    from .autoscale import AutoscaleRun, markdown, run

    if not args.cluster.is_file():
        raise ConfigError(f"--cluster {args.cluster} does not exist")
    if args.max_devices < 1 or args.concurrency < 1 or args.idle_timeout_s <= 0 or args.phase_timeout_s <= 0:
        raise ConfigError("--max-devices, --concurrency, --idle-timeout-s and --phase-timeout-s must be positive")
    out = args.out or _default_out("autoscale")
    try:
        result = run(AutoscaleRun(out=out, cluster=args.cluster, node_type=args.node_type,
                                  max_devices=args.max_devices, idle_timeout_s=args.idle_timeout_s,
                                  concurrency=args.concurrency, phase_timeout_s=args.phase_timeout_s))
    except TimeoutError as exc:  # a step that did not happen in time: the run measured nothing
        sys.stderr.write(f"s2d: error: {exc}\n")
        return 1
    sys.stdout.write(markdown(result))
    return 1 if result["requests"]["failed"] else 0


def run_cross_node(args: argparse.Namespace) -> int:
    from .cross_node import CrossNodeRun, markdown, run

    if min(args.reps, args.requests, args.max_tokens, args.k) < 1:
        raise ConfigError("--reps, --requests, --max-tokens and --k must be positive")
    result = run(CrossNodeRun(out=args.out or _default_out("cross-node"), reps=args.reps, requests=args.requests,
                              max_tokens=args.max_tokens, k=args.k))
    sys.stdout.write(markdown(result))
    return 0 if result["equal_outputs"] else 1
