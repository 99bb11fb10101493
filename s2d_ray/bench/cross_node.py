"""`s2d bench cross-node`: what a speculative round pays when the draft and the target sit on other nodes than the
router, against all three on one node.

A Ray cluster of three nodes on this machine (`ray.cluster_utils.Cluster`, every raylet on 127.0.0.1), each with a
custom resource naming it; two apps of the same tiny random target and a draft cut from it, placed by those
resources: `one-node` (router, draft and target on the head) and `cross-node` (router on the head, the draft on one
worker node, the target on the other). Single streams, greedy, fixed k, alternating between the apps `--reps`
times; the routers' own clocks (/stats `timing`) give per round its wall time and per deployment call its wall
time and the replica's part, whose difference is the price of the call itself. Where each replica runs is read
back from Ray's state API (a run whose replicas are elsewhere stops), and the two placements' greedy outputs are
compared. The cross-node price less the one-node price, per call, is the fleet model's `cross_node_ms`
(docs/FLEET.md). Nodes on one host talk over loopback: the figure is the cost of Ray's cross-node path (object
transfer between raylets included) without a network's latency, a floor for a real cluster.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from .gpu_serve import TINY_CONFIG  # the same small random target as the dry runs
from .server_clocks import timing_delta

TARGET = "tiny-random"
NODES = {"head": "s2d_node_head", "draft": "s2d_node_draft", "target": "s2d_node_target"}
PLACEMENTS = {"one-node": {"router": "head", "draft": "head", "target": "head"},
              "cross-node": {"router": "head", "draft": "draft", "target": "target"}}


@dataclass
class CrossNodeRun:
    out: Path
    reps: int = 5
    requests: int = 4  # per rep and app, one at a time
    max_tokens: int = 32
    k: int = 4


def app_args(target_dir: Path, placement: dict[str, str], k: int) -> dict:
    """A tiny app whose router, draft and target each ask for a share of the named node's resource."""
    on = lambda role: {"num_cpus": 0, "resources": {NODES[placement[role]]: 0.01}}  # noqa: E731
    return {
        "targets": [{"name": TARGET, "source": str(target_dir), "dtype": "float32", **on("target")}],
        "draft": {"source": f"cut:{target_dir}:2", "dtype": "float32", "batch_wait_timeout_s": 0.0, **on("draft")},
        "spec": {"mode": "s2d", "policy": "fixed", "k": k},
        "router": on("router"),
        "limits": {"max_total_tokens": 512, "max_tokens_limit": 256, "request_timeout_s": 120},
        "num_threads": 1,
    }


def start_cluster(dashboard_port: int):
    """Head + two worker nodes on 127.0.0.1, each with its naming resource; the driver connected. The head's
    dashboard serves Ray's state API (where each replica runs)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster

    store = 80 * 1024 ** 2
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {NODES["head"]: 1}, "node_ip_address": "127.0.0.1", "include_dashboard": True,
        "dashboard_host": "127.0.0.1", "dashboard_port": dashboard_port, "object_store_memory": store})
    for role in ("draft", "target"):
        cluster.add_node(num_cpus=2, resources={NODES[role]: 1}, node_ip_address="127.0.0.1", object_store_memory=store)
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def stats_timing(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/stats", timeout=60.0).json()["targets"][TARGET]["timing"]


def complete(url: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    """One greedy completion: its text and token count."""
    import httpx

    r = httpx.post(f"{url}/v1/completions", json={"model": TARGET, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0}, timeout=120.0)
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["text"], int(body["usage"]["completion_tokens"])


def replica_nodes(dashboard_url: str) -> dict[str, dict[str, str]]:
    """Per app and deployment, the naming resource of the node each live replica runs on (Ray's state API)."""
    import ray
    from ray.util.state import list_actors

    names = {n["NodeID"]: next((r for r in NODES.values() if r in n["Resources"]), "?") for n in ray.nodes()
             if n["Alive"]}
    out: dict[str, dict[str, str]] = {}
    for a in list_actors(address=dashboard_url, filters=[("state", "=", "ALIVE")], limit=1000):
        parts = (a.class_name or "").split(":")  # ServeReplica:<app>:<deployment>
        if len(parts) == 3 and parts[0] == "ServeReplica" and parts[1] in PLACEMENTS:
            role = "target" if parts[2].startswith("target-") else parts[2]
            if role in PLACEMENTS[parts[1]]:  # the app's singletons (metrics hub) go where the router's kind of node is
                out.setdefault(parts[1], {})[role] = names.get(a.node_id, "?")
    return out


def run(cfg: CrossNodeRun) -> dict:
    """Both apps on one cluster, alternating; results written to cfg.out/cross_node.json."""
    from ..fleet.local_autoscaler import free_port
    from ..hardware import machine_info
    from ..models.random_init import write_random_model
    from .gpu_serve import deploy, prompts

    cfg.out.mkdir(parents=True, exist_ok=True)
    target_dir = write_random_model(cfg.out / "models" / TARGET, TINY_CONFIG)
    dashboard_port = free_port()
    cluster = start_cluster(dashboard_port)
    try:
        from ray import serve

        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        urls = {}
        for name, placement in PLACEMENTS.items():
            deploy(app_args(target_dir, placement, cfg.k), name)
            urls[name] = f"http://127.0.0.1:{port}/{name}"
        seen = replica_nodes(f"http://127.0.0.1:{dashboard_port}")
        if seen != placement_of(PLACEMENTS):
            raise RuntimeError(f"replicas are not where their resources place them: {seen}")
        texts = prompts(cfg.requests, TINY_CONFIG["vocab_size"])
        for url in urls.values():  # warm-up: first calls pay imports and compiles
            complete(url, texts[0], 8)
        samples: dict[str, list[dict]] = {name: [] for name in PLACEMENTS}
        outputs: dict[str, list[str]] = {name: [] for name in PLACEMENTS}
        for _ in range(cfg.reps):
            for name, url in urls.items():
                before = stats_timing(url)
                done = [complete(url, t, cfg.max_tokens) for t in texts]
                delta = timing_delta(before, stats_timing(url))
                outputs[name].extend(text for text, _ in done)
                if delta:
                    samples[name].append({**delta, "tokens": sum(n for _, n in done)})
        serve.shutdown()
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()
    summary = {name: summarize(s) for name, s in samples.items()}
    one, cross = summary["one-node"], summary["cross-node"]
    extra = {role: round(cross[role]["overhead_ms"] - one[role]["overhead_ms"], 3) for role in ("target", "draft")}
    result = {"machine": machine_info(), "settings": {**asdict(cfg), "out": str(cfg.out)}, "replica_nodes": seen,
              "equal_outputs": outputs["one-node"] == outputs["cross-node"], "summary": summary, "samples": samples,
              "cross_node_extra_ms": {"per_round": round(cross["round_ms"] - one["round_ms"], 3), "per_call": extra,
                                      "per_call_mean": round(statistics.mean(extra.values()), 3)}}
    (cfg.out / "cross_node.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def placement_of(placements: dict) -> dict:
    """Which node (by its naming resource) each app's deployments ask for."""
    return {name: {role: NODES[node] for role, node in p.items()} for name, p in placements.items()}


def summarize(samples: list[dict]) -> dict:
    """Medians over reps: round ms, and per deployment the call's wall, replica and overhead ms."""
    med = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
    out = {"reps": len(samples), "rounds": sum(s["rounds"] for s in samples),
           "round_ms": med([s["round_ms"] for s in samples])}
    for role in ("target", "draft"):
        rows = [s[role] for s in samples if role in s]
        out[role] = {k: med([r[k] for r in rows]) for k in ("call_ms", "replica_ms", "overhead_ms")}
        out[role]["calls"] = sum(r["calls"] for r in rows)
    return out



def markdown(result: dict) -> str:
    lines = ["| placement | round ms | target call ms (overhead) | draft call ms (overhead) |", "|---|---|---|---|"]
    for name, s in result["summary"].items():
        lines.append(f"| {name} | {s['round_ms']} | {s['target']['call_ms']} ({s['target']['overhead_ms']}) | "
                     f"{s['draft']['call_ms']} ({s['draft']['overhead_ms']}) |")
    x = result["cross_node_extra_ms"]
    lines.append(f"\ngreedy outputs of the two placements equal: {result['equal_outputs']}")
    lines.append(f"cross-node extra: {x['per_round']} ms per round, {x['per_call_mean']} ms per call "
                 f"(target {x['per_call']['target']}, draft {x['per_call']['draft']})")
    return "\n".join(lines) + "\n"

