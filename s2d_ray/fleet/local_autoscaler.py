"""Ray's own autoscaler on one machine, with node types derived from cluster.yaml (Ray's fake multi-node provider).

`local_node_types` is THE derivation (docs/SERVING.md, "Autoscaling from cluster.yaml"): every worker node type of
cluster.yaml keeps its name, its custom resources (the slots an app config's `resources:` asks for, one per GPU),
its min_workers and max_workers; it loses its GPUs (none here: the custom resource stands for the device) and its
CPUs scale so the largest node type has this host's cores (at least 1). `max_devices` caps the custom resources per
node so that a small app already needs a second node (a real gpu_small node holds 4 replicas; a laptop runs few).

`LocalAutoscalingCluster` starts a head whose monitor runs the autoscaler with the provider config built here
(`fake_multinode`: each node it adds is a raylet process on this host), and stops everything it started by
process id.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from .cluster import ClusterSpec, NodeType

NODE_TYPE_LABEL = "s2d-node-type"  # every derived node carries its cluster.yaml node type as a Ray node label
FAKE_HEAD_TYPE = "ray.head.default"  # the fake provider names its head so
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
OBJECT_STORE_BYTES = 80 * 1024 ** 2  # per node; Ray's minimum is 75 MiB
MONITOR_PROCESS = "monitor"  # the autoscaler monitor's key in a Ray node's process table


def local_resources(node: NodeType, cpu_scale: float, max_devices: int | None) -> dict[str, int]:
    """One node type's resources on this host: custom resources kept (capped at `max_devices`), GPUs dropped,
    CPUs scaled by `cpu_scale` (at least 1; the autoscaler's schema takes whole numbers)."""
    out = {"CPU": max(1, round(node.resources.get("CPU", 1) * cpu_scale))}
    for k, v in node.resources.items():
        if k in ("CPU", "GPU") or v <= 0:
            continue
        out[k] = int(min(v, max_devices)) if max_devices else int(v)
    return out


def local_node_types(cluster: ClusterSpec, host_cpus: int | None = None, max_devices: int | None = None,
                     idle_timeout_s: float | None = None) -> tuple[dict[str, int], dict[str, dict[str, Any]]]:
    """The head's resources and the autoscaler's worker node types, derived from cluster.yaml (module docstring)."""
    host_cpus = host_cpus or os.cpu_count() or 1
    cpu_scale = host_cpus / max(t.resources.get("CPU", 1) for t in cluster.node_types)
    types: dict[str, dict[str, Any]] = {}
    for t in cluster.workers:
        spec: dict[str, Any] = {
            "resources": {**local_resources(t, cpu_scale, max_devices), "object_store_memory": OBJECT_STORE_BYTES},
            "node_config": {}, "min_workers": t.min_workers, "max_workers": t.max_workers,
            "labels": {NODE_TYPE_LABEL: t.name}}
        if idle_timeout_s is not None:
            spec["idle_timeout_s"] = idle_timeout_s
        types[t.name] = spec
    return local_resources(cluster.head, cpu_scale, max_devices), types


def autoscaler_config(cluster: ClusterSpec, gcs_address: str, head_resources: dict[str, int],
                      worker_types: dict[str, dict[str, Any]], idle_timeout_s: float | None = None) -> dict[str, Any]:
    """The whole `fake_multinode` cluster config the monitor reads (it fills in no defaults, so every field the
    autoscaler reads is here)."""
    idle_min = idle_timeout_s / 60 if idle_timeout_s is not None else cluster.idle_timeout_minutes
    return {
        "cluster_name": cluster.name, "max_workers": cluster.max_workers, "upscaling_speed": cluster.upscaling_speed,
        "idle_timeout_minutes": idle_min,
        "provider": {"type": "fake_multinode", "gcs_address": gcs_address, "disable_launch_config_check": True,
                     "disable_node_updaters": True, "use_node_id_as_ip": True},
        "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
        "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
        "available_node_types": {FAKE_HEAD_TYPE: {"resources": head_resources, "node_config": {}, "max_workers": 0},
                                 **worker_types},
        "head_node_type": FAKE_HEAD_TYPE,
    }


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalAutoscalingCluster:
    """A Ray head on 127.0.0.1 whose autoscaler adds and removes raylets of cluster.yaml's node types."""

    def __init__(self, cluster: ClusterSpec, max_devices: int | None = 1, idle_timeout_s: float = 5.0,
                 host_cpus: int | None = None, update_interval_s: int = 1):
        self.cluster = cluster
        self.idle_timeout_s = idle_timeout_s
        self.update_interval_s = update_interval_s
        self.head_resources, self.worker_types = local_node_types(cluster, host_cpus, max_devices, idle_timeout_s)
        self._ray_cluster = None
        self._config_path: Path | None = None
        self.address: str | None = None

    def start(self) -> "LocalAutoscalingCluster":
        # Every node on loopback: Ray reads this when imported (here and in the monitor and raylets it starts).
        os.environ.setdefault(LOOPBACK_ENV, "0")
        if os.environ[LOOPBACK_ENV] != "0":
            raise RuntimeError(f"set {LOOPBACK_ENV}=0 before ray is imported: the nodes must bind 127.0.0.1")
        from ray.cluster_utils import Cluster

        port = free_port()
        self.address = f"127.0.0.1:{port}"
        config = autoscaler_config(self.cluster, self.address, self.head_resources, self.worker_types,
                                   self.idle_timeout_s)
        fd, path = tempfile.mkstemp(prefix="s2d-autoscaler-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(config, f)
        self._config_path = Path(path)
        # Read by the monitor process the head starts: the provider refuses to run without RAY_FAKE_CLUSTER.
        os.environ["RAY_FAKE_CLUSTER"] = "1"
        os.environ["AUTOSCALER_UPDATE_INTERVAL_S"] = str(self.update_interval_s)
        head = dict(self.head_resources)
        self._ray_cluster = Cluster(initialize_head=True, head_node_args={
            "gcs_server_port": port, "node_ip_address": "127.0.0.1", "num_cpus": head.pop("CPU"), "resources": head,
            "object_store_memory": OBJECT_STORE_BYTES, "autoscaling_config": path,
            # The dashboard serves Ray's state API (which node each actor runs on).
            "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": free_port()})
        return self

    def __enter__(self) -> "LocalAutoscalingCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def dashboard_url(self) -> str:
        """Where Ray's state API answers for this cluster (give it explicitly: other clusters may run here)."""
        return f"http://{self._ray_cluster.webui_url}"

    def _monitor_pids(self) -> list[int]:
        head = self._ray_cluster.head_node if self._ray_cluster else None
        if head is None:
            return []
        return [p.process.pid for p in head.all_processes.get(MONITOR_PROCESS, [])]

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the worker raylets the autoscaler started (the monitor's child processes, by pid), then the head."""
        import psutil
        import ray

        if ray.is_initialized():  # a driver connected to the head would break when the head goes
            ray.shutdown()
        procs = []
        for pid in self._monitor_pids():
            try:
                procs += psutil.Process(pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        for p in procs:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=timeout_s / 2)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            if self._ray_cluster is not None:
                self._ray_cluster.shutdown()
                self._ray_cluster = None
        finally:
            if self._config_path is not None:
                self._config_path.unlink(missing_ok=True)


def node_types_alive() -> dict[str, int]:
    """Alive worker nodes per cluster.yaml node type (from the node label the derivation sets)."""
    import ray

    counts: dict[str, int] = {}
    for n in ray.nodes():
        kind = (n.get("Labels") or {}).get(NODE_TYPE_LABEL)
        if n.get("Alive") and kind:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.5):
    """Poll `predicate` until it returns a truthy value; a TimeoutError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(interval_s)


__all__ = ["NODE_TYPE_LABEL", "LocalAutoscalingCluster", "autoscaler_config", "free_port", "local_node_types",
           "local_resources", "node_types_alive", "wait_for"]
