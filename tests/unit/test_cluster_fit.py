"""`s2d plan --cluster`: deployments/gpu.yaml against cluster.yaml, and broken pairs that must fail naming the
deployment and the node type (the negative controls)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from s2d_ray.cli import main
from s2d_ray.fleet.cluster import ClusterFitError, check_fit, demands, read_cluster
from s2d_ray.fleet.plan import read_app_config

ROOT = Path(__file__).parents[2]
GPU_YAML, CLUSTER_YAML = ROOT / "deployments" / "gpu.yaml", ROOT / "cluster.yaml"


def _edit(src: Path, dst: Path, change) -> Path:
    doc = yaml.safe_load(src.read_text())
    change(doc)
    dst.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dst


def _target(doc: dict, name: str) -> dict:
    return next(t for t in doc["applications"][0]["args"]["targets"] if t["name"] == name)


def test_the_shipped_pair_fits():
    cluster = read_cluster(CLUSTER_YAML)
    report = check_fit(read_app_config(GPU_YAML), cluster)
    assert report.placements["targets[llama-2-70b-chat]"] == ["gpu_large"]
    assert report.placements["draft"] == ["gpu_small"]
    # 2 drafts + 4 + 4 single-GPU replicas on 4-GPU nodes; two TP-4 groups on one 8-GPU node.
    assert report.nodes_at_max == {"head": 1, "gpu_small": 3, "gpu_large": 1, "gpu_train": 0}


def test_a_tp_replica_counts_its_whole_placement_group():
    tp = next(d for d in demands(read_app_config(GPU_YAML)) if d.deployment == "targets[llama-2-70b-chat]")
    assert len(tp.bundles) == 5  # the replica + 4 ranks
    assert tp.need == {"CPU": 33.0, "GPU": 4.0, "s2d_large_gpu": 4.0}


@pytest.mark.parametrize("change, message", [
    # 16 ranks do not fit one 8-GPU node: STRICT_PACK cannot split the group.
    (lambda d: _target(d, "llama-2-70b-chat").update(tp_size=16),
     r"targets\[llama-2-70b-chat\]: one replica is a placement group of 17 bundles .*node type gpu_large has"),
    (lambda d: _target(d, "vicuna-7b-v1.5").update(resources={"s2d_smal_gpu": 1}),
     r"targets\[vicuna-7b-v1\.5\]: .*no node type declares s2d_smal_gpu"),
    (lambda d: _target(d, "vicuna-13b-v1.5")["autoscaling_config"].update(max_replicas=12),
     r"targets\[vicuna-13b-v1\.5\]: max_replicas of .* need 5 gpu_small nodes; node type gpu_small has max_workers 4"),
])
def test_a_broken_config_names_the_deployment_and_the_node_type(tmp_path, capsys, change, message):
    broken = _edit(GPU_YAML, tmp_path / "gpu.yaml", change)
    with pytest.raises(ClusterFitError, match=message):
        check_fit(read_app_config(broken), read_cluster(CLUSTER_YAML))
    assert main(["plan", str(broken), "--cluster", str(CLUSTER_YAML)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("s2d: error: targets[")


def test_a_smaller_cluster_fails_on_max_workers(tmp_path, capsys):
    def shrink(doc):
        doc["available_node_types"]["gpu_large"]["max_workers"] = 0
    small = _edit(CLUSTER_YAML, tmp_path / "cluster.yaml", shrink)
    assert main(["plan", str(GPU_YAML), "--cluster", str(small)]) == 2
    assert "targets[llama-2-70b-chat]: max_replicas of targets[llama-2-70b-chat] need 1 gpu_large nodes; node type " \
           "gpu_large has max_workers 0" in capsys.readouterr().err


def test_the_plan_cli_prints_the_fit_table(capsys):
    assert main(["plan", str(GPU_YAML), "--cluster", str(CLUSTER_YAML)]) == 0
    out = capsys.readouterr().out
    assert "| gpu_small | 3 | 4 |" in out and "| gpu_large | 1 | 2 | targets[llama-2-70b-chat] x2 |" in out
