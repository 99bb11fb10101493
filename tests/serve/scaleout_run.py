"""A scale-out check as one command: deploy deployments/replicas.yaml (2 replicas each of router, draft and target;
`--replicas 1` for the baseline) on a private local Ray, send streaming requests at concurrency 16 with
`s2d bench serve`'s load, and print one JSON line: tok/s, errors, generated and recomputed tokens (per deployment and
replica, from every router's /stats), and the peak RSS of every replica process (sampled during the load).

    PYTHONPATH=$PWD timeout 1800 .venv/bin/python tests/serve/scaleout_run.py --requests 32

`--scale-down-at 60` redeploys the app with one replica of each 60 s into the load (a scale-down by redeploy): every
request must still complete. Recomputed tokens of replicas that went away are lost with their routers, so the figure
then undercounts. `--kill draft --kill-at 10` (or `--kill target-<name>`) kills one replica of that deployment 10 s
into the load (a fault under load). `--check-greedy` asks for every response's token ids and, once the app is gone
(so the CPUs are free), compares them with in-process greedy decoding of the same prompt by the project's engine
(`--mode ar`, same target, same dtype; `s2d_ray/bench/greedy_check.py`); `--dtype float32` serves (and checks) in
fp32, where equality must be exact.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import psutil
import yaml

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_args(replicas: int, dtype: str | None = None, spec: dict | None = None) -> dict:
    args = yaml.safe_load((REPO / "deployments" / "replicas.yaml").read_text())["applications"][0]["args"]
    args["spec"] = spec or args["spec"]
    for opts in (args["draft"], args["router"], *args["targets"]):
        opts["num_replicas"] = replicas
    for opts in (args["draft"], *args["targets"]):
        if dtype is not None:
            opts["dtype"] = dtype
    return args


def kill_one(deployment: str) -> str:
    """Kill the first (by name) replica of `deployment` of app `s2d`, as a crash would."""
    import ray

    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith(f"SERVE_REPLICA::s2d#{deployment}#"))
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    return names[0]


class PeakRss:
    """Peak resident memory of every Serve replica process of app `s2d`, sampled in a thread."""

    def __init__(self) -> None:
        self.peak: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for proc in psutil.process_iter(["pid", "cmdline"]):
                title = " ".join(proc.info["cmdline"] or [])
                if "ServeReplica:s2d:" not in title:
                    continue
                try:
                    mib = proc.memory_info().rss / 2**20
                except psutil.Error:
                    continue
                key = f"{title.split('ServeReplica:s2d:')[1].split()[0]}:{proc.info['pid']}"
                self.peak[key] = max(self.peak.get(key, 0.0), mib)
            time.sleep(0.5)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def router_health(url: str, routers: int) -> list[dict]:
    seen: dict[str, dict] = {}
    for _ in range(200):
        body = httpx.get(f"{url}/stats", timeout=30).json()
        seen[body["router"]] = body
        if len(seen) == routers:
            break
    return list(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--scale-down-at", type=float, default=None,
                        help="seconds into the load: redeploy the app with --scale-down-to replicas of each (as "
                        "`serve deploy` of the edited file would) while requests run")
    parser.add_argument("--scale-down-to", type=int, default=1)
    parser.add_argument("--kill", default=None, help="a deployment (draft, target-<name>, router): kill one of its "
                        "replicas --kill-at seconds into the load")
    parser.add_argument("--kill-at", type=float, default=10.0)
    parser.add_argument("--dtype", default=None, help="dtype of the draft and target replicas (default: the file's)")
    parser.add_argument("--spec", type=json.loads, default=None, help="the app's spec as JSON, e.g. "
                        "'{\"mode\": \"s2d\", \"policy\": \"fixed\", \"k\": 4}' (fp32's calibration models no "
                        "gain, so its budget leaves the draft idle: a fixed k makes the check exercise speculation)")
    parser.add_argument("--check-greedy", action="store_true",
                        help="compare every response's token ids with in-process greedy (after the app is gone)")
    parser.add_argument("--reference-cache", type=Path, default=REPO / "bench_results" / "scaleout" / "greedy_ref.json",
                        help="in-process greedy ids kept across runs (keyed by target, dtype, prompt, max_tokens)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON line's object here")
    parser.add_argument("--questions", type=Path, default=None, help="Spec-Bench question.jsonl (default: "
                        "$S2D_DATA_DIR/spec_bench/question.jsonl if it exists, else four built-in prompts)")
    args = parser.parse_args()

    import ray
    from ray import serve

    from s2d_ray.bench.serve import LoadRun, mixed_prompts, run_load
    from s2d_ray.serve import build_app

    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             object_store_memory=256 * 2**20)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    cfg = app_args(args.replicas, args.dtype, args.spec)
    t0 = time.monotonic()
    serve.run(build_app(cfg), name="s2d", route_prefix="/")
    deploy_s = time.monotonic() - t0
    url = f"http://127.0.0.1:{port}"
    model = cfg["targets"][0]["name"]
    run = LoadRun(url, model, [args.concurrency], requests=args.requests, max_seconds=1200.0,
                  max_tokens=args.max_tokens, timeout=600.0, return_token_ids=args.check_greedy)
    redeploy: dict = {}
    killed: dict = {}

    def scale_down() -> None:
        t = time.monotonic()
        serve.run(build_app(app_args(args.scale_down_to, args.dtype, args.spec)), name="s2d", route_prefix="/")
        redeploy.update(at_s=args.scale_down_at, to=args.scale_down_to, running_after_s=round(time.monotonic() - t, 1))

    def kill() -> None:
        import ray

        name = kill_one(args.kill)
        killed.update(replica=name, at_s=args.kill_at)
        t = time.monotonic()
        while time.monotonic() - t < 300:  # until Serve has noticed and replaced it
            state = serve.status().applications["s2d"].deployments[args.kill]
            alive = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
            if (name not in alive and state.status == "HEALTHY"
                    and state.replica_states.get("RUNNING", 0) == args.replicas):
                killed["healthy_again_after_s"] = round(time.monotonic() - t, 1)
                break
            time.sleep(0.5)

    timers = [threading.Timer(args.scale_down_at, scale_down)] if args.scale_down_at is not None else []
    timers += [threading.Timer(args.kill_at, kill)] if args.kill else []
    prompts = mixed_prompts(args.questions)
    with PeakRss() as rss:
        for timer in timers:
            timer.start()
        result = asyncio.run(run_load(run, prompts))
        for timer in timers:
            timer.join()
    summary = result["summary"][0]
    routers = args.scale_down_to if args.scale_down_at is not None else args.replicas
    health = router_health(url, routers)
    recomputed: dict[str, dict[str, int]] = {}
    for h in health:
        for dep, per_replica in h["recomputed_tokens"].items():
            for rep, n in per_replica.items():
                recomputed.setdefault(dep, {})[rep] = recomputed.setdefault(dep, {}).get(rep, 0) + n
    line = {
        "replicas": args.replicas, "dtype": cfg["targets"][0].get("dtype", "auto"), "deploy_s": round(deploy_s, 1), "sent": summary["sent"],
        "completed": summary["completed"], "errors": summary["errors"], "error_samples": summary["error_samples"],
        "output_tokens": summary["output_tokens"], "wall_s": round(summary["wall_seconds"], 1),
        "tok_per_s": round(summary["throughput_tokens_per_s"], 2), "recomputed_tokens": recomputed,
        "recomputed_pct": round(100 * sum(n for d in recomputed.values() for n in d.values())
                                / max(summary["output_tokens"], 1), 2),
        "peak_rss_mib": {k: round(v) for k, v in sorted(rss.peak.items())},
        "per_router": {h["router"]: h["recomputed_tokens"] for h in health},  # the replicas each router used
        "draft_stats": [h["draft"] for h in health], "redeploy": redeploy or None, "killed": killed or None}
    serve.shutdown()
    ray.shutdown()
    if args.check_greedy:
        from s2d_ray.bench.greedy_check import GreedyCheck, check_greedy, greedy_markdown
        from s2d_ray.serve.app_config import AppConfig

        engine = AppConfig.model_validate(cfg).engine_config(model)
        line["greedy_check"] = check_greedy(result, prompts, GreedyCheck(engine, cache=args.reference_cache))
        print(greedy_markdown(line["greedy_check"]))
    print("SCALEOUT", json.dumps(line))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**line, "requests": result["requests"]}, indent=1))


if __name__ == "__main__":
    main()
