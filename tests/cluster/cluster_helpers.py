"""A multi-node Ray cluster on this machine: a head and worker nodes, each its own raylet (Ray's
`ray.cluster_utils.Cluster`, the machinery of `ray start --address`), bound to 127.0.0.1, with the custom resources of
cluster.yaml's node types (`s2d_small_gpu`: the draft's nodes, `s2d_large_gpu`: the targets'). A node is lost by
killing its raylet and every process on it.

Node deaths are noticed fast here (GCS health checks every 0.5 s, dead after 3 misses): the default (several
seconds) would only make the tests wait longer for the same outcome.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

DEPLOY_TIMEOUT_S = 240
# (name, custom resources): cluster.yaml's node types, one of each role plus a spare to reschedule onto.
WORKER_NODES = (
    ("small-0", {"s2d_small_gpu": 1}),
    ("small-1", {"s2d_small_gpu": 1}),
    ("large-0", {"s2d_large_gpu": 1}),
    ("large-1", {"s2d_large_gpu": 1}),
)
NODE_CPUS = 4  # logical: the tests' replicas reserve fractions of one
FAST_NODE_DEATH = {"health_check_period_ms": 500, "health_check_timeout_ms": 1000,
                   "health_check_failure_threshold": 3, "health_check_initial_delay_ms": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalCluster:
    """The running cluster: Ray's Cluster object, its nodes by name, the HTTP port of Serve and the dashboard (the
    state API's) address."""

    cluster: object
    port: int  # Serve's HTTP port, chosen when Serve starts (a port picked before the nodes start may be taken)
    dashboard: str
    nodes: dict = field(default_factory=dict)  # name -> ray._private.node.Node

    def node_name(self, node_id: str) -> str:
        return next((n for n, node in self.nodes.items() if node.node_id == node_id), node_id)

    def kill(self, name: str) -> None:
        """Lose a node: its raylet and every process on it killed at once (no graceful shutdown)."""
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)

    def add(self, name: str, resources: dict[str, float]) -> None:
        self.nodes[name] = self.cluster.add_node(num_cpus=NODE_CPUS, node_ip_address="127.0.0.1",
                                                 resources=resources)


def start_cluster(workers=WORKER_NODES) -> LocalCluster:
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # a one-node Ray of earlier tests in this process; the cluster needs its own
        ray.shutdown()
    dashboard_port = free_port()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": NODE_CPUS, "node_ip_address": "127.0.0.1", "include_dashboard": True,
        "dashboard_host": "127.0.0.1", "dashboard_port": dashboard_port, "_system_config": FAST_NODE_DEATH})
    local = LocalCluster(cluster, 0, f"http://127.0.0.1:{dashboard_port}", {"head": cluster.head_node})
    for name, resources in workers:
        local.add(name, resources)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False)
    return local


def deploy(app, name: str, port: int, wait: bool = True) -> str:
    """serve.run without its unbounded wait (RUNNING within DEPLOY_TIMEOUT_S, or fail, unless not `wait`); the
    app's URL."""
    from ray import serve

    serve._run(app, _blocking=False, name=name, route_prefix=f"/{name}")
    deadline = time.monotonic() + DEPLOY_TIMEOUT_S
    while wait:
        status = serve.status().applications.get(name)
        if status is not None and status.status == "RUNNING":
            break
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"app {name} failed: {status.message} {status.deployments}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"app {name} not RUNNING after {DEPLOY_TIMEOUT_S} s: {status}")
        time.sleep(0.5)
    return f"http://127.0.0.1:{port}/{name}"


def replicas_by_node(local: LocalCluster, app: str) -> dict[str, list[str]]:
    """deployment -> the names of the nodes its live replicas run on, from Ray's state API."""
    from ray.util.state import list_actors

    out: dict[str, list[str]] = {}
    for actor in list_actors(address=local.dashboard, filters=[("state", "=", "ALIVE")], limit=1000):
        prefix = f"ServeReplica:{app}:"
        if actor.class_name.startswith(prefix):
            out.setdefault(actor.class_name[len(prefix):], []).append(local.node_name(actor.node_id))
    return {k: sorted(v) for k, v in out.items()}
