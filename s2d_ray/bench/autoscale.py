"""`s2d bench autoscale [--cluster cluster.yaml]`: Ray's autoscaler adding and removing nodes of cluster.yaml's types
as Serve scales a target under load, on this machine (s2d_ray/fleet/local_autoscaler.py).

The app: a tiny random target that asks for one unit of `--node-type`'s custom resource (as gpu.yaml's targets ask
for `s2d_small_gpu`), min 1 and max 2 replicas, scaling on its ongoing calls; the router (holding the draft, cut
from the target) on the head. With `--max-devices 1` each derived node holds one such replica, so:

    load starts -> Serve asks for a 2nd replica -> the autoscaler adds a node of that type -> the replica serves
    load stops -> Serve removes a replica -> the node goes idle -> the autoscaler removes it

Recorded (seconds): request to node (Serve asks for the replica -> the node is alive), node to serving replica (->
the replica RUNNING), idle to replica removal and idle to node removal (load stopped -> ...), with the node types
that came and went and every request's status. Each wait is bounded by `--phase-timeout-s`.
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import ConfigError
from .gpu_serve import TINY_CONFIG  # the same small random target as the dry runs

APP, TARGET = "autoscale", "tiny-random"
# Serve's replicas and handles report their load every 10 s by default; 1 s keeps a run short. What is timed here
# starts once Serve has decided (the replica is requested), so this does not shorten any recorded interval.
SERVE_ENV = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
             "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1"}


@dataclass
class AutoscaleRun:
    out: Path
    cluster: Path = Path("cluster.yaml")
    node_type: str = "gpu_small"
    max_devices: int = 1
    idle_timeout_s: float = 5.0
    concurrency: int = 4
    max_tokens: int = 24
    phase_timeout_s: float = 120.0


@dataclass
class Load:
    """Client threads sending completions until stopped; every response's status kept."""

    url: str
    concurrency: int
    max_tokens: int
    statuses: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _client(self, i: int) -> None:
        import httpx

        prompt = " ".join(f"w{3 + (7 * i + 13 * j) % 500}" for j in range(12))
        with httpx.Client(timeout=60.0) as client:
            while not self._stop.is_set():
                try:
                    r = client.post(f"{self.url}/v1/completions", json={
                        "model": TARGET, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0})
                    self.statuses.append(r.status_code)
                except httpx.HTTPError:
                    self.statuses.append(-1)

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(self.concurrency)]
        for t in self._threads:
            t.start()

    def stop(self, timeout_s: float = 90.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)


def node_resource(cluster, node_type: str) -> str:
    """The custom resource that places a replica on `node_type` (the first it declares)."""
    types = {t.name: t for t in cluster.workers}
    if node_type not in types:
        raise ConfigError(f"--node-type {node_type}: not a worker node type of the cluster config "
                          f"({', '.join(sorted(types))})")
    custom = [k for k, v in types[node_type].resources.items() if k not in ("CPU", "GPU") and v > 0]
    if not custom:
        raise ConfigError(f"--node-type {node_type}: declares no custom resource for a replica to ask for")
    return custom[0]


def app_args(target_dir: Path, resource: str) -> dict:
    """A tiny app whose target asks for one `resource` and scales 1..2 on its ongoing calls (a router keeps one call
    in flight per target replica: 0.5 asks for a 2nd replica as soon as a round is in flight)."""
    return {
        "targets": [{"name": TARGET, "source": str(target_dir), "dtype": "float32", "num_cpus": 0,
                     "resources": {resource: 1}, "max_concurrent_sequences": 8,
                     "health_check_period_s": 1.0,
                     "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 0.5,
                                            "upscale_delay_s": 1, "downscale_delay_s": 2, "look_back_period_s": 2}}],
        "draft": {"source": f"cut:{target_dir}:2", "dtype": "float32", "placement": "router"},
        "spec": {"mode": "s2d", "policy": "fixed", "k": 3},
        "router": {"num_cpus": 0},
        "limits": {"max_concurrent_sequences": 8, "max_queued_requests": 64, "max_total_tokens": 512,
                   "max_tokens_limit": 64, "request_timeout_s": 120},
        "num_threads": 1,
    }


def target_replicas() -> dict[str, int]:
    """The target deployment's replica states (RUNNING, STARTING, STOPPING, ...) from serve.status()."""
    from ray import serve

    app = serve.status().applications.get(APP)
    dep = app.deployments.get(f"target-{TARGET}") if app else None
    return {str(k): int(v) for k, v in (dep.replica_states if dep else {}).items()}


def replica_node_types(dashboard_url: str) -> list[str]:
    """The node type (derived label) of every alive target replica actor, from Ray's state API."""
    import ray
    from ray.util.state import list_actors

    from ..fleet.local_autoscaler import NODE_TYPE_LABEL

    labels = {n["NodeID"]: (n.get("Labels") or {}).get(NODE_TYPE_LABEL, "head") for n in ray.nodes() if n["Alive"]}
    actors = list_actors(address=dashboard_url, filters=[("state", "=", "ALIVE")], limit=1000)
    return sorted(labels.get(a.node_id, "?") for a in actors if f"target-{TARGET}" in (a.class_name or ""))


def run(cfg: AutoscaleRun) -> dict:
    """Start the local autoscaling cluster, deploy, load, unload; the timings written to cfg.out/autoscale.json."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    for k, v in SERVE_ENV.items():
        os.environ.setdefault(k, v)
    from ..fleet.cluster import read_cluster
    from ..fleet.local_autoscaler import LocalAutoscalingCluster, free_port, node_types_alive, wait_for
    from ..hardware import machine_info
    from ..models.random_init import write_random_model
    from .gpu_serve import deploy

    # Serve compares look_back_period_s with the deprecated metrics_interval_s (10 s); the push intervals that
    # matter are SERVE_ENV's.
    warnings.filterwarnings("ignore", message=".*look_back_period_s.*", category=FutureWarning)
    cluster = read_cluster(cfg.cluster)
    resource = node_resource(cluster, cfg.node_type)
    cfg.out.mkdir(parents=True, exist_ok=True)
    target_dir = write_random_model(cfg.out / "models" / TARGET, TINY_CONFIG)
    local = LocalAutoscalingCluster(cluster, max_devices=cfg.max_devices, idle_timeout_s=cfg.idle_timeout_s)
    events: dict[str, float] = {}
    t0 = time.monotonic()  # events count from the cluster's start: min_workers_up is the head and its first nodes
    mark = lambda name: events.setdefault(name, round(time.monotonic() - t0, 2))  # noqa: E731
    with local:
        import ray
        from ray import serve

        ray.init(address=local.address, log_to_driver=False)
        baseline = wait_for(lambda: node_types_alive() if sum(node_types_alive().values()) >= sum(
            t.min_workers for t in cluster.workers) else None, cfg.phase_timeout_s, "the min_workers nodes")
        mark("min_workers_up")
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        deploy(app_args(target_dir, resource), APP)
        mark("app_running")
        before = node_types_alive()
        first_nodes = replica_node_types(local.dashboard_url)
        load = Load(f"http://127.0.0.1:{port}/{APP}", cfg.concurrency, cfg.max_tokens)
        load.start()
        mark("load_start")
        try:
            wait_for(lambda: sum(target_replicas().values()) > 1, cfg.phase_timeout_s, "Serve asking for a replica")
            mark("replica_requested")
            wait_for(lambda: node_types_alive().get(cfg.node_type, 0) > before.get(cfg.node_type, 0),
                     cfg.phase_timeout_s, f"the autoscaler adding a {cfg.node_type} node")
            mark("node_alive")
            peak = node_types_alive()
            wait_for(lambda: target_replicas().get("RUNNING", 0) >= 2, cfg.phase_timeout_s, "the new replica RUNNING")
            mark("replica_running")
            scaled_nodes = replica_node_types(local.dashboard_url)
            time.sleep(2.0)  # the new replica takes a share of the load before the load stops
        finally:
            load.stop()
        mark("load_stop")
        wait_for(lambda: target_replicas() == {"RUNNING": 1}, cfg.phase_timeout_s, "Serve removing the replica")
        mark("replica_removed")
        wait_for(lambda: node_types_alive() == before, cfg.phase_timeout_s + cfg.idle_timeout_s,
                 f"the autoscaler removing the idle {cfg.node_type} node")
        mark("node_removed")
        serve.shutdown()
        ray.shutdown()
    e = events
    result = {
        "machine": machine_info(), "settings": {**asdict(cfg), "out": str(cfg.out), "cluster": str(cfg.cluster),
                                               "resource": resource, "serve_env": SERVE_ENV},
        "node_types": {"head": local.head_resources, **{k: v["resources"] for k, v in local.worker_types.items()}},
        "events_s": e,
        "nodes": {"at_start": baseline, "before_load": before, "peak": peak, "after": before},
        "replica_node_types": {"before_load": first_nodes, "scaled": scaled_nodes},
        "requests": {"ok": sum(s == 200 for s in load.statuses), "failed": sum(s != 200 for s in load.statuses),
                     "statuses": sorted(set(load.statuses))},
        "times_s": {"request_to_node": round(e["node_alive"] - e["replica_requested"], 2),
                    "node_to_serving_replica": round(e["replica_running"] - e["node_alive"], 2),
                    "idle_to_replica_removal": round(e["replica_removed"] - e["load_stop"], 2),
                    "idle_to_node_removal": round(e["node_removed"] - e["load_stop"], 2)},
    }
    (cfg.out / "autoscale.json").write_text(json.dumps(result, indent=1, default=str))
    return result



def markdown(result: dict) -> str:
    t, s = result["times_s"], result["settings"]
    return (f"node type {s['node_type']} (resource {s['resource']}), idle_timeout_s {s['idle_timeout_s']}: "
            f"request to node {t['request_to_node']} s, node to serving replica {t['node_to_serving_replica']} s, "
            f"idle to replica removal {t['idle_to_replica_removal']} s, idle to node removal "
            f"{t['idle_to_node_removal']} s; requests ok {result['requests']['ok']}, failed "
            f"{result['requests']['failed']}\n")
