"""Ray's own autoscaler driven by cluster.yaml's node types (Ray's fake multi-node provider: every node a raylet on
this host): under load Serve asks for a target replica, the autoscaler adds a node of the type the replica's
resources name, the replica serves there; when the load stops the replica and the node go away. Run as
`s2d bench autoscale` in a subprocess (its own Ray cluster, whatever else this process runs), every wait bounded.

Negative control: the same run against a cluster.yaml whose gpu_small max_workers leaves no room for a 2nd node
fails, naming the step that did not happen.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from s2d_ray.fleet.cluster import read_cluster
from s2d_ray.fleet.local_autoscaler import autoscaler_config, local_node_types

pytestmark = pytest.mark.serve

ROOT = Path(__file__).parents[2]
CLUSTER_YAML = ROOT / "cluster.yaml"


def bench(out: Path, cluster: Path, phase_timeout_s: float, timeout_s: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    return subprocess.run([sys.executable, "-m", "s2d_ray.cli", "bench", "autoscale", "--out", str(out), "--cluster",
                           str(cluster), "--phase-timeout-s", str(phase_timeout_s)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)


def test_node_types_are_derived_from_cluster_yaml(tmp_path):
    cluster = read_cluster(CLUSTER_YAML)
    head, types = local_node_types(cluster, host_cpus=2, max_devices=1, idle_timeout_s=5)
    assert set(types) == {"gpu_small", "gpu_large", "gpu_train"}  # every worker type, none invented
    assert types["gpu_small"]["resources"] == {"CPU": 1, "s2d_small_gpu": 1, "object_store_memory": 80 * 1024 ** 2}
    assert (types["gpu_small"]["min_workers"], types["gpu_small"]["max_workers"]) == (1, 4)
    assert head == {"CPU": 1}
    # Uncapped, a node keeps all its device slots; an edit to cluster.yaml shows up in the derived config.
    assert local_node_types(cluster, host_cpus=2)[1]["gpu_large"]["resources"]["s2d_large_gpu"] == 8
    doc = yaml.safe_load(CLUSTER_YAML.read_text())
    doc["available_node_types"]["gpu_small"]["resources"]["s2d_small_gpu"] = 2
    doc["available_node_types"]["gpu_small"]["max_workers"] = 3
    edited = tmp_path / "cluster.yaml"
    edited.write_text(yaml.safe_dump(doc))
    small = local_node_types(read_cluster(edited), host_cpus=2)[1]["gpu_small"]
    assert small["resources"]["s2d_small_gpu"] == 2 and small["max_workers"] == 3
    config = autoscaler_config(cluster, "127.0.0.1:1", head, types, idle_timeout_s=5)
    assert config["provider"]["type"] == "fake_multinode" and config["max_workers"] == 12


def test_the_autoscaler_adds_and_removes_a_node_of_the_right_type(tmp_path):
    run = bench(tmp_path / "out", CLUSTER_YAML, phase_timeout_s=90, timeout_s=420)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads((tmp_path / "out" / "autoscale.json").read_text())
    assert r["nodes"]["before_load"] == {"gpu_small": 1}  # min_workers: 1
    assert r["nodes"]["peak"] == {"gpu_small": 2}  # one more, of the type the target's resource names, nothing else
    assert r["nodes"]["after"] == {"gpu_small": 1}
    assert r["replica_node_types"] == {"before_load": ["gpu_small"], "scaled": ["gpu_small", "gpu_small"]}
    assert r["requests"]["failed"] == 0 and r["requests"]["ok"] > 0
    assert all(v > 0 for v in r["times_s"].values()), r["times_s"]


def test_no_room_for_a_node_fails_naming_the_step(tmp_path):
    doc = yaml.safe_load(CLUSTER_YAML.read_text())
    doc["available_node_types"]["gpu_small"]["max_workers"] = 1  # = min_workers: no 2nd node
    tight = tmp_path / "cluster.yaml"
    tight.write_text(yaml.safe_dump(doc))
    run = bench(tmp_path / "out", tight, phase_timeout_s=15, timeout_s=300)
    assert run.returncode == 1
    assert "s2d: error: the autoscaler adding a gpu_small node: not within 15 s" in run.stderr
