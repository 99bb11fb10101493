"""`s2d bench lora-serve`: served throughput with requests spread over N LoRA adapters of one base, against the same
adapters merged into N separate targets (the served counterpart of `s2d bench lora`).

For each adapter count N, two Ray Serve apps on 127.0.0.1, one after the other, each with the one sorted draft:
`lora`, ONE target (the base) carrying the N adapters under `lora:`, every adapter a model name of its own and
every round's rows verified in one forward over one copy of the base; and `merged`, N targets, each the base with one
adapter merged into its weights (bench/lora.py's `merged_model`), one replica each. The same streaming
`/v1/completions` requests go to both, request i to model i mod N, at a fixed concurrency, greedy, first speculative
(S2D) and then plain (`speculate: false`, the same requests through the same app, as `s2d bench serve
--compare-plain`). Reported per N: output tokens/s of the four runs, S2D / plain, one base / merged, the resident
memory of each app's target replicas, and whether each request's tokens from the two apps are equal. Outputs are
compared, not required equal: in float32 and bfloat16 the unmerged sum rounds differently from merged weights, so a
near-tie may part (docs/SERVING.md, "LoRA targets").

Every merged target takes the base's calibration profile, the speculation settings the adapters' rows run under. The
adapters are the ones given (committed adapters by name, or peft directories), then seeded noisy copies of them
(bench/lora.py's `adapters`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..commands.engine_args import INTS
from ..config import DEFAULT_DRAFT, DEFAULT_TARGET
from ..errors import ConfigError
from .lora import ADAPTER_COUNTS, PROMPTS

COMMITTED = ["smollm2-135m-gsm8k", "smollm2-135m-code"]
VARIANTS = (("s2d", True), ("plain", False))
APPS = ("lora", "merged")  # one base carrying the adapters; the adapters merged as targets


@dataclass
class LoraServeRun:
    target: str = DEFAULT_TARGET  # the base: a named model or an HF directory
    draft: str = DEFAULT_DRAFT
    adapter: list[str] = field(default_factory=lambda: list(COMMITTED))  # first; noisy copies of them beyond
    counts: list[int] = field(default_factory=lambda: list(ADAPTER_COUNTS))
    requests: int = 16  # per run, spread round-robin over the adapters
    max_tokens: int = 64
    concurrency: int = 8
    warmup: int = 2  # requests per app and variant, one after another, not counted
    dtype: str = "float32"
    threads: int = 1  # torch threads per replica
    replica_cpus: float = 0.1  # Ray CPUs each replica asks for (router, draft, each target): N + 2 of them fit
    calibration: str = "auto"  # the base's profile for every target; `off`: none
    port: int | None = None  # Serve's HTTP port on 127.0.0.1; None: a free one
    timeout: float = 600.0  # per request and per run
    prompts: list[str] = field(default_factory=lambda: list(PROMPTS))
    progress: bool = True


def register(bench) -> None:
    p = bench.add_parser("lora-serve", help="served: requests spread over 1, 2, 4, 8 LoRA adapters of one base in "
                         "one app against the same adapters merged as separate targets, S2D and plain")
    d = LoraServeRun()
    p.add_argument("--target", default=d.target, help="the base model (named model or HF directory)")
    p.add_argument("--draft", default=d.draft, help="the sorted draft both apps share")
    p.add_argument("--adapter", action="append", default=None, metavar="PATH_OR_NAME",
                   help="a peft adapter of the base (repeatable; a path or a committed adapter's name); default "
                   f"{', '.join(COMMITTED)}; counts above those given use seeded noisy copies of them")
    p.add_argument("--adapters", type=INTS, default=d.counts,
                   help="adapter counts to measure (comma list; default 1,2,4,8: the largest sets how many merged "
                   "targets run at once, each a full copy of the base in a process of its own)")
    p.add_argument("--requests", type=int, default=d.requests, help="requests per run, request i to adapter i mod N")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="max_tokens per request")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight")
    p.add_argument("--warmup", type=int, default=d.warmup, help="requests per app and variant sent first, not counted")
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16", "float64"])
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per replica")
    p.add_argument("--replica-cpus", type=float, default=d.replica_cpus,
                   help="Ray CPUs each replica reserves (router, draft and every target)")
    p.add_argument("--calibration", default=d.calibration,
                   help="auto: the base's profile for the base and every merged target; off: none")
    p.add_argument("--port", type=int, default=None, help="Serve's HTTP port on 127.0.0.1 (default: a free one)")
    p.add_argument("--timeout", type=float, default=d.timeout, help="seconds per request")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    run = LoraServeRun(target=args.target, draft=args.draft, adapter=args.adapter or list(COMMITTED),
                       counts=args.adapters, requests=args.requests, max_tokens=args.max_tokens,
                       concurrency=args.concurrency, warmup=args.warmup, dtype=args.dtype, threads=args.threads,
                       replica_cpus=args.replica_cpus, calibration=args.calibration, port=args.port,
                       timeout=args.timeout, progress=not args.no_progress)
    check(run)
    report = measure(start(run))
    print(table(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return 1 if failures(report) else 0


def check(run: LoraServeRun) -> None:
    """One line for settings that cannot run, before anything starts."""
    if not run.counts or min(run.counts) < 1:
        raise ConfigError("--adapters: a comma list of counts >= 1")
    if min(run.requests, run.max_tokens, run.concurrency, run.threads) < 1 or run.warmup < 0:
        raise ConfigError("--requests, --max-tokens, --concurrency and --threads must be >= 1, --warmup >= 0")
    if run.replica_cpus <= 0 or run.timeout <= 0:
        raise ConfigError("--replica-cpus and --timeout must be positive")
    from ..serve.lora_config import adapter_path

    for a in run.adapter:
        if not (adapter_path(a) / "adapter_config.json").is_file():
            raise ConfigError(f"--adapter {a}: not a peft adapter directory (no adapter_config.json)")
    names = [adapter_path(a).name for a in run.adapter]
    if len(set(names)) != len(names):
        raise ConfigError(f"--adapter: each adapter is served under its directory's name, and these repeat: {names}")


def start(run: LoraServeRun) -> LoraServeRun:
    """Ray and Serve's HTTP proxy on 127.0.0.1 (bench/gpu_serve.py's), on run.port or a free port; the run with it."""
    from ..fleet.local_autoscaler import free_port
    from .gpu_serve import start_serve

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # else Ray binds the external address
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    run = replace(run, port=run.port or free_port())
    start_serve(run.port, "cpu")
    return run


def measure(run: LoraServeRun) -> dict:
    """Every count, both apps, both variants, on the Serve already started on run.port; the adapters' files and the
    merged targets live in a temporary directory for the run."""
    from tqdm.auto import tqdm

    from ..build import load_target
    from ..config import EngineConfig, TargetConfig
    from .lora import adapters

    base = load_target(EngineConfig(target=TargetConfig(name=run.target, dtype=run.dtype)), "cpu")
    most = max(run.counts)
    report: dict = {"settings": {k: v for k, v in asdict(run).items() if k != "prompts"}, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        given = argparse.Namespace(adapter=run.adapter, rank=8, scale=0.002)
        paths = adapters(base.model, Path(tmp) / "adapters", most, given)
        names = adapter_names(run.adapter, paths)
        report["adapters"] = dict(zip(names, [adapter_source(run.adapter, i) for i in range(len(paths))]))
        profile = base_profile(run)
        prompts = chat_texts(base.tokenizer, run.prompts)
        bar = tqdm(total=len(run.counts) * len(APPS) * len(VARIANTS), desc="lora-serve",
                   disable=not run.progress, dynamic_ncols=True)
        merged_dir = Path(tmp) / "merged"
        for n in sorted(run.counts):
            row: dict = {"adapters": n}
            for kind in APPS:
                if kind == "merged":
                    merge_into(base, dict(zip(names[:n], paths[:n])), merged_dir)
                cfg = app_args(run, kind, dict(zip(names[:n], paths[:n])), merged_dir, profile)
                # this process's id in the name: the replicas' memory is read by their app's name, host-wide
                row[kind] = serve_app(run, f"lora-{kind}-{n}-{os.getpid()}", cfg, prompts, names[:n], bar)
            row.update(compare(row, run.requests))
            report["rows"].append(row)
            bar.write(summary_line(row))
        bar.close()
        shutil.rmtree(merged_dir, ignore_errors=True)
    return report


def chat_texts(tokenizer, prompts: list[str]) -> list[str]:
    """Each prompt as a chat's first user turn in the tokenizer's template, as text for /v1/completions (an instruct
    model given the bare text often ends at once); the bare prompts where the tokenizer has no template."""
    from ..prompts import encode_prompt

    if not getattr(tokenizer, "chat_template", None):
        return list(prompts)
    return [tokenizer.decode(encode_prompt(tokenizer, p, chat=True)) for p in prompts]


def adapter_source(given: list[str], i: int) -> str:
    """What adapter i is, as the command named it (a record names no directory of the machine it ran on)."""
    if i < len(given):
        return given[i]
    return f"noisy copy of {given[i % len(given)]}" if given else "random"


def adapter_names(given: list[str], paths: list[Path]) -> list[str]:
    """Model names: a given adapter's directory name, its noisy copies that name with `-noisy<i>`."""
    names = [Path(p).name for p in paths[:len(given)]]
    return names + [f"{names[i % len(names)]}-noisy{i}" for i in range(len(names), len(paths))]


def base_profile(run: LoraServeRun) -> str:
    """The base's calibration profile (what `auto` picks for it), given to every merged target; `off` where none."""
    from ..build import calibration_path
    from ..config import DraftConfig, EngineConfig, TargetConfig

    if run.calibration != "auto":
        return run.calibration
    path = calibration_path(EngineConfig(target=TargetConfig(name=run.target, dtype=run.dtype),
                                         draft=DraftConfig(source=run.draft)))
    return str(path) if path is not None else "off"


def merge_into(base, adapters: dict[str, Path], root: Path) -> None:
    """Each adapter merged into the base and saved (with the base's tokenizer) as `root/<name>`, once."""
    from .lora import merged_model

    for name, path in adapters.items():
        if not (root / name).is_dir():
            merged_model(base.model, path).save_pretrained(root / name)
            base.tokenizer.save_pretrained(root / name)


def app_args(run: LoraServeRun, kind: str, adapters: dict[str, Path], merged_dir: Path, profile: str) -> dict:
    """`lora`: the base carrying the adapters under `lora:`; `merged`: one target per adapter merged in. The rest is the
    same: every replica `replica_cpus` and `threads`, rows for the concurrency, the one draft."""
    rows = run.concurrency
    common = {"dtype": run.dtype, "num_cpus": run.replica_cpus, "max_concurrent_sequences": rows,
              "max_live_sequences": rows}
    if kind == "lora":
        from ..models.adapters import read_peft_adapter

        rank = max(read_peft_adapter(p).rank for p in adapters.values())
        targets = [{"name": Path(run.target).name, "source": run.target, **common,
                    **({"calibration": run.calibration} if run.calibration != "auto" else {}),
                    "lora": {"adapters": {k: str(v) for k, v in adapters.items()}, "max_loaded": len(adapters),
                             "max_rank": rank}}]
    else:
        targets = [{"name": name, "source": str(merged_dir / name), "calibration": profile, **common}
                   for name in adapters]
    return {
        "targets": targets,
        "draft": {"source": run.draft, "dtype": run.dtype, "num_cpus": run.replica_cpus,
                  "max_live_sequences": rows * len(targets), "max_batch_size": len(targets)},
        "spec": {"mode": "s2d"},
        "router": {"num_cpus": run.replica_cpus},
        # Each row's KV sized for these requests (short chat prompts), not the model's whole context: N merged
        # targets each keep their own rows, and the memory compared is the weights'.
        "limits": {"max_concurrent_sequences": rows, "max_queued_requests": 4 * rows, "max_prompt_tokens": 512,
                   "max_total_tokens": 512 + run.max_tokens, "max_tokens_limit": run.max_tokens,
                   "request_timeout_s": run.timeout},
        "num_threads": run.threads,
    }


def serve_app(run: LoraServeRun, name: str, cfg: dict, prompts: list[str], models: list[str], bar) -> dict:
    """Deploy the app, run both variants (each after its warm-up), read its replicas' memory, delete it."""
    from ray import serve

    from .gpu_serve import deploy

    deploy(cfg, name)
    try:
        out = asyncio.run(load_app(run, f"http://127.0.0.1:{run.port}/{name}", prompts, models, bar))
        out["replica_rss_bytes"] = replica_rss(name)
    finally:
        serve.delete(name)
    return out


async def load_app(run: LoraServeRun, url: str, prompts: list[str], models: list[str], bar) -> dict:
    """Both variants at run.concurrency: request i (prompt i mod the prompts) to models[i mod N], token ids kept."""
    import time

    import httpx

    from .serve import LoadRun, level_summary, run_level

    texts = [prompts[i % len(prompts)] for i in range(max(run.requests, run.concurrency))]
    load = LoadRun(url=url, model=models[0], concurrency=[run.concurrency], requests=run.requests,
                   max_seconds=run.timeout, max_tokens=run.max_tokens, timeout=run.timeout, return_token_ids=True)
    limits = httpx.Limits(max_connections=run.concurrency, max_keepalive_connections=run.concurrency)
    out = {}
    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
        for label, speculate in VARIANTS:
            level = replace(load, speculate=speculate)
            if run.warmup:
                await run_level(client, replace(level, requests=run.warmup), 1, texts, models, by_request=True)
            t0 = time.perf_counter()
            results = await run_level(client, level, run.concurrency, texts, models, by_request=True)
            summary = level_summary(run.concurrency, results, time.perf_counter() - t0)
            out[label] = {**summary, "token_ids": {r.prompt_index: r.token_ids for r in results if r.ok}}
            bar.update(1)
    return out


def replica_rss(app: str) -> dict[str, dict[str, int]]:
    """Resident bytes of each of the app's Serve replica processes on this host, by deployment, from /proc: `rss`
    (VmRSS) and `anon` (RssAnon: without the pages of mapped weight files, which the kernel may drop and re-read).
    Ray's title of a replica's process holds `ServeReplica:<app>:<deployment>`, then `.<method>` while one runs.
    Empty where /proc is not there."""
    out: dict[str, dict[str, int]] = {}
    key = f"ServeReplica:{app}:"
    for pid in (p for p in os.listdir("/proc") if p.isdigit()) if os.path.isdir("/proc") else ():
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            if not title.startswith("ray::") or key not in title:
                continue
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:  # the process ended, or is not ours to read
            continue
        deployment = (title.split(key, 1)[1].split() or ["?"])[0]
        head, _, method = deployment.rpartition(".")
        deployment = head if head and method.isidentifier() else deployment
        fields = {line.split(":")[0]: line.split() for line in status.splitlines()}
        got = out.setdefault(deployment, {"rss": 0, "anon": 0})
        for name, field_name in (("rss", "VmRSS"), ("anon", "RssAnon")):
            got[name] += int(fields[field_name][1]) * 1024 if field_name in fields else 0
    return out


def target_rss(app: dict, kind: str = "rss") -> int:
    """Resident bytes of an app's target replicas (every deployment but the router, the draft and the metrics hub)."""
    return sum(v[kind] for k, v in app["replica_rss_bytes"].items() if k.startswith("target"))


def compare(row: dict, requests: int) -> dict:
    """Per variant, requests whose token ids are equal in the two apps; per app, S2D against plain; the ratios."""
    out: dict = {"equal": {}, "ratio": {}}

    def equal(a: dict, b: dict) -> dict:
        both = sorted(set(a) & set(b))
        differ = [i for i in both if a[i] is None or a[i] != b[i]]
        return {"compared": len(both), "equal": len(both) - len(differ), "differ": differ}

    for label, _ in VARIANTS:
        out["equal"][f"lora=merged {label}"] = equal(row["lora"][label]["token_ids"],
                                                         row["merged"][label]["token_ids"])
        a, m = (row[k][label]["throughput_tokens_per_s"] for k in APPS)
        out["ratio"][f"lora/merged {label}"] = a / m if m else None
    for kind in APPS:
        out["equal"][f"{kind} s2d=plain"] = equal(row[kind]["s2d"]["token_ids"], row[kind]["plain"]["token_ids"])
        s, p = (row[kind][label]["throughput_tokens_per_s"] for label, _ in VARIANTS)
        out["ratio"][f"{kind} s2d/plain"] = s / p if p else None
    return out


def failures(report: dict) -> list[str]:
    """What fails the run: a request that did not complete (differences are reported, not failed)."""
    return [f"adapters={row['adapters']} {kind} {label}: {row[kind][label]['errors']} errors "
            f"{row[kind][label]['error_samples']}"
            for row in report["rows"] for kind in APPS for label, _ in VARIANTS
            if row[kind][label]["errors"] or not row[kind][label]["completed"]]


def summary_line(row: dict) -> str:
    tok = {(k, v): row[k][v]["throughput_tokens_per_s"] for k in APPS for v, _ in VARIANTS}
    return (f"adapters={row['adapters']}: one base s2d {tok['lora', 's2d']:.1f} plain {tok['lora', 'plain']:.1f}"
            f" tok/s; merged s2d {tok['merged', 's2d']:.1f} plain {tok['merged', 'plain']:.1f} tok/s")


def table(report: dict) -> str:
    """Tokens/s of the four runs and their ratios per adapter count, then equality and the targets' memory."""
    f = lambda x: "-" if x is None else f"{x:.2f}"
    lines = [("| adapters | one base S2D | one base plain | merged S2D | merged plain | S2D/plain one base | "
              "S2D/plain merged | one base/merged S2D | one base/merged plain |"), "|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        tok = [row[k][v]["throughput_tokens_per_s"] for k in APPS for v, _ in VARIANTS]
        r = row["ratio"]
        lines.append(f"| {row['adapters']} | " + " | ".join(f"{t:.1f}" for t in tok) + " | " + " | ".join(
            f(r[k]) for k in ("lora s2d/plain", "merged s2d/plain", "lora/merged s2d", "lora/merged plain")) + " |")
    lines += ["", ("| adapters | equal S2D (one base vs merged) | equal plain | targets' RSS one base (MiB) | "
                   "targets' RSS merged (MiB) | anonymous one base | anonymous merged |"), "|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        e = row["equal"]
        eq = [f"{e[k]['equal']}/{e[k]['compared']}" for k in ("lora=merged s2d", "lora=merged plain")]
        rss = [target_rss(row[k], m) / 2**20 for m in ("rss", "anon") for k in APPS]
        lines.append(f"| {row['adapters']} | {eq[0]} | {eq[1]} | " + " | ".join(f"{x:.0f}" for x in rss) + " |")
    return "\n".join(lines) + "\n"
