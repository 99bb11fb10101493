"""`s2d bench autoscale` and `s2d bench cross-node` without a cluster: what they place where, their summaries, and
bad arguments (one line, exit 2). The runs themselves: tests/serve/test_serve_autoscaler.py, BENCHMARKS.md 13."""

from __future__ import annotations

from pathlib import Path

import pytest

from s2d_ray.bench.autoscale import app_args as autoscale_args
from s2d_ray.bench.autoscale import node_resource
from s2d_ray.bench.cross_node import NODES, PLACEMENTS, summarize
from s2d_ray.bench.cross_node import app_args as cross_args
from s2d_ray.cli import main
from s2d_ray.errors import ConfigError
from s2d_ray.fleet.cluster import read_cluster
from s2d_ray.serve.app_config import AppConfig

CLUSTER_YAML = Path(__file__).parents[2] / "cluster.yaml"


def test_cross_node_apps_put_draft_and_target_off_the_routers_node(tmp_path):
    where = {}
    for name, placement in PLACEMENTS.items():
        cfg = AppConfig.model_validate(cross_args(tmp_path, placement, 4))
        where[name] = {role: set(opts.resources) for role, opts in
                       (("router", cfg.router), ("draft", cfg.draft), ("target", cfg.targets[0]))}
    assert where["one-node"] == {r: {NODES["head"]} for r in ("router", "draft", "target")}
    assert where["cross-node"] == {"router": {NODES["head"]}, "draft": {NODES["draft"]}, "target": {NODES["target"]}}


def test_cross_node_summary_takes_medians_over_reps():
    rep = lambda ms, over: {"rounds": 10, "round_ms": ms, "target": {"calls": 10, "call_ms": ms / 2, "replica_ms": 1.0,  # noqa: E731
                                                                "overhead_ms": over}}
    s = summarize([rep(10.0, 2.0), rep(30.0, 9.0), rep(12.0, 3.0)])
    assert (s["reps"], s["rounds"], s["round_ms"]) == (3, 30, 12.0)
    assert s["target"] == {"call_ms": 6.0, "replica_ms": 1.0, "overhead_ms": 3.0, "calls": 30}
    assert s["draft"] == {"call_ms": None, "replica_ms": None, "overhead_ms": None, "calls": 0}


def test_autoscale_target_asks_for_the_node_types_resource(tmp_path):
    cluster = read_cluster(CLUSTER_YAML)
    assert node_resource(cluster, "gpu_large") == "s2d_large_gpu"
    cfg = AppConfig.model_validate(autoscale_args(tmp_path, node_resource(cluster, "gpu_small")))
    assert cfg.targets[0].resources == {"s2d_small_gpu": 1} and not cfg.router.resources
    with pytest.raises(ConfigError, match="--node-type head: not a worker node type"):
        node_resource(cluster, "head")


@pytest.mark.parametrize("args, message", [
    (["autoscale", "--node-type", "gpu_xl"], "--node-type gpu_xl: not a worker node type of the cluster config"),
    (["autoscale", "--cluster", "missing.yaml"], "--cluster missing.yaml does not exist"),
    (["autoscale", "--max-devices", "0"], "must be positive"),
    (["cross-node", "--reps", "0"], "must be positive"),
])
def test_bad_arguments_are_one_line(capsys, args, message):
    assert main(["bench", *args, "--out", "/nonexistent/never-written"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
