"""`s2d bench gpu-serve --out DIR [--tiny]`: the served app on one GPU, as an operator deploys it.

A real Ray Serve application on one machine: the router on the CPU (no GPU reserved), a Llama-2-7B-shaped target with
random weights built on the GPU from its config alone (models/random_init.py) and a draft cut from the target's first
layers on the same GPU. OpenAI streaming requests at each concurrency, every level twice through the same app:
speculative, then plain (`speculate: false`, the same requests). Two phases:

1. float32: every greedy response of S2D equals AR's, token for token (any difference fails the run);
2. bfloat16: output tokens/s and time to first token per level, both variants (differences at rounding near-ties
   are reported, not failed).

Each phase records the device, dtype and peak device memory the replicas report in /stats. Without a GPU the command
stops at once with one line; `--tiny` runs the same app with small shapes on the CPU (the dry run a test runs).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import ConfigError
from ..fleet.shapes import SHAPES

logger = logging.getLogger(__name__)

APP, TARGET = "gpu-serve", "llama-2-7b-random"
PHASES = (("equality", "float32"), ("speed", "bfloat16"))
TINY_CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
               "num_hidden_layers": 4, "vocab_size": 512, "max_position_embeddings": 1024}
DEPLOY_TIMEOUT_S = 600.0


@dataclass
class GpuServe:
    out: Path
    tiny: bool = False
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    max_tokens: int = 64
    requests: int = 32  # per level and variant (at least the level's concurrency)
    draft_layers: int = 4  # the draft: the target's first layers (exits at thirds of them)
    port: int = 8000
    phases: tuple[tuple[str, str], ...] = PHASES


def require_gpu(tiny: bool) -> str:
    """The device the run uses; without a GPU (and not --tiny), one line and no start."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if tiny:
        return "cpu"
    raise ConfigError("s2d bench gpu-serve needs a CUDA GPU and none is visible here; --tiny runs the same app on the "
                      "CPU with small shapes")


def model_config(tiny: bool) -> dict:
    """The target's config: Llama-2-7B's shapes (32 layers), or tiny ones."""
    return dict(TINY_CONFIG) if tiny else SHAPES["llama-2-7b"].hf_config()


def app_args(target_dir: Path, dtype: str, device: str, run: GpuServe) -> dict:
    """The Serve app: the router on the CPU, the target and the draft each on half the GPU (on the CPU, a quarter
    core each: the dry run fits a 2-core machine)."""
    gpu = {"num_gpus": 0.5, "num_cpus": 1} if device == "cuda" else {"num_cpus": 0.25}
    rows = max(run.concurrency)
    return {
        "targets": [{"name": TARGET, "source": str(target_dir), "dtype": dtype, **gpu,
                     "max_concurrent_sequences": rows, "max_live_sequences": rows, "max_batch_size": rows}],
        "draft": {"source": f"cut:{target_dir}:{run.draft_layers}", "dtype": dtype, **gpu,
                  "max_live_sequences": rows, "max_batch_size": rows, "batch_wait_timeout_s": 0.0},
        "spec": {"mode": "s2d", "policy": "heuristic", "k": 4},
        "router": {"num_cpus": gpu["num_cpus"]},
        "limits": {"max_concurrent_sequences": rows, "max_queued_requests": 4 * rows, "max_total_tokens": 1024,
                   "max_prompt_tokens": 512, "max_tokens_limit": run.max_tokens, "request_timeout_s": 600},
        "num_threads": 1,
    }


def prompts(n: int, vocab: int) -> list[str]:
    """Word-id prompts of different lengths (the random model's tokenizer maps w<i> to id i)."""
    return [" ".join(f"w{3 + (17 * p + 31 * i) % (vocab - 3)}" for i in range(8 + 5 * p)) for p in range(n)]


def start_serve(port: int, device: str) -> None:
    """Ray (one GPU when there is one) and Serve's HTTP proxy on 127.0.0.1, unless a Serve is already up."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address="local", num_gpus=1 if device == "cuda" else 0, include_dashboard=False,
                 _node_ip_address="127.0.0.1", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})


def deploy(args: dict, name: str) -> None:
    """The app deployed and RUNNING, or an error with Serve's message (bounded wait)."""
    from ray import serve

    from ..serve import build_app

    serve._run(build_app(args), _blocking=False, name=name, route_prefix=f"/{name}")
    deadline = time.monotonic() + DEPLOY_TIMEOUT_S
    while time.monotonic() < deadline:
        status = serve.status().applications.get(name)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status == "DEPLOY_FAILED":
            raise ConfigError(f"app {name} failed to deploy: {status.message}")
        time.sleep(1.0)
    raise ConfigError(f"app {name} not RUNNING after {DEPLOY_TIMEOUT_S:.0f} s")


def equal_outputs(result: dict, concurrency: list[int]) -> dict:
    """Per level: the requests whose speculative and plain token ids are equal (same prompt, same max_tokens)."""
    out = {}
    for c in concurrency:
        spec = {r["prompt_index"]: r["token_ids"] for r in result["requests"][f"{c}-speculative"] if r["ok"]}
        plain = {r["prompt_index"]: r["token_ids"] for r in result["requests"][f"{c}-plain"] if r["ok"]}
        both = sorted(set(spec) & set(plain))
        differ = [i for i in both if spec[i] is None or spec[i] != plain[i]]
        out[str(c)] = {"compared": len(both), "equal": len(both) - len(differ), "differ": differ}
    return out


async def replica_devices(url: str) -> dict:
    """Device, dtype and device memory of the router, the draft and the target, from /stats."""
    import httpx

    async with httpx.AsyncClient(trust_env=False) as client:
        health = (await client.get(f"{url}/stats", timeout=30.0)).json()
    keys = ("device", "dtype", "device_memory_peak_bytes", "device_memory_reserved_bytes", "max_live_sequences")
    pick = lambda d: {k: d.get(k) for k in keys if k in d}  # noqa: E731
    return {"router": pick(health), "draft": pick(health.get("draft") or {}),
            "target": pick(health["targets"][TARGET]["deployment"])}


def run_phase(run: GpuServe, target_dir: Path, label: str, dtype: str, device: str) -> dict:
    """One app in `dtype`: every level speculative and plain, compared; the app deleted afterwards."""
    from ray import serve

    from .serve import LoadRun, run_load

    name = f"{APP}-{label}"
    deploy(app_args(target_dir, dtype, device, run), name)
    url = f"http://127.0.0.1:{run.port}/{name}"
    try:
        load = LoadRun(url=url, model=TARGET, concurrency=run.concurrency, requests=run.requests,
                       max_tokens=run.max_tokens, max_seconds=600.0, timeout=600.0, compare_plain=True,
                       return_token_ids=True, warmup=2)
        texts = prompts(max(run.requests, max(run.concurrency)), int(model_config(run.tiny)["vocab_size"]))
        result = asyncio.run(run_load(load, texts))
        devices = asyncio.run(replica_devices(url))
    finally:
        serve.delete(name)
    return {"dtype": dtype, "summary": result["summary"], "equal": equal_outputs(result, run.concurrency),
            "devices": devices, "warmup": result["warmup"]}


def run(cfg: GpuServe) -> dict:
    """Both phases on one Serve instance; results written to cfg.out/gpu_serve.json."""
    from ..hardware import machine_info
    from ..models.random_init import write_random_model

    device = require_gpu(cfg.tiny)
    cfg.out.mkdir(parents=True, exist_ok=True)
    target_dir = write_random_model(cfg.out / "models" / TARGET, model_config(cfg.tiny))
    start_serve(cfg.port, device)
    phases = {label: run_phase(cfg, target_dir, label, dtype, device) for label, dtype in cfg.phases}
    result = {"machine": machine_info(), "device": device, "tiny": cfg.tiny, "phases": phases,
              "settings": {"concurrency": cfg.concurrency, "max_tokens": cfg.max_tokens, "requests": cfg.requests,
                           "draft_layers": cfg.draft_layers}}
    (cfg.out / "gpu_serve.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def failures(result: dict) -> list[str]:
    """What fails the run: errors at any level, and any S2D != AR difference in the float32 phase."""
    out = []
    for label, phase in result["phases"].items():
        out += [f"{label} c={row['concurrency']} {row.get('variant')}: {row['errors']} errors {row['error_samples']}"
                for row in phase["summary"] if row["errors"] or not row["completed"]]
        if phase["dtype"] in ("float32", "float64"):
            out += [f"{label} c={c}: S2D != AR for prompts {e['differ']}" for c, e in phase["equal"].items()
                    if e["differ"]]
    return out


def markdown(result: dict) -> str:
    """One table per phase: tokens/s and TTFT p50 of S2D and AR per level, equal outputs, and device memory."""
    lines = []
    for label, phase in result["phases"].items():
        rows = {(r["concurrency"], r["variant"]): r for r in phase["summary"]}
        lines += [f"### {label} ({phase['dtype']}, {result['device']})", "",
                  "| concurrency | S2D tok/s | AR tok/s | S2D / AR | TTFT p50 ms S2D | TTFT p50 ms AR | S2D == AR |",
                  "|---|---|---|---|---|---|---|"]
        for c in sorted({c for c, _ in rows}):
            s, p, e = rows[(c, "speculative")], rows[(c, "plain")], phase["equal"][str(c)]
            ratio = s["throughput_tokens_per_s"] / p["throughput_tokens_per_s"] if p["throughput_tokens_per_s"] else 0
            lines.append(f"| {c} | {s['throughput_tokens_per_s']:.1f} | {p['throughput_tokens_per_s']:.1f} | "
                         f"{ratio:.2f} | {s['ttft_ms_p50'] or 0:.0f} | {p['ttft_ms_p50'] or 0:.0f} | "
                         f"{e['equal']}/{e['compared']} |")
        lines += ["", "devices: " + json.dumps(phase["devices"]), ""]
    return "\n".join(lines)


def tiny_run(out: Path, port: int) -> GpuServe:
    """The dry run's settings: small shapes, a few levels and tokens (what the test runs)."""
    return replace(GpuServe(out=out, tiny=True, port=port), concurrency=[1, 4], max_tokens=12, requests=4,
                   draft_layers=2)
