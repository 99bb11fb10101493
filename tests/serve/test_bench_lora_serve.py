"""`s2d bench lora-serve` end to end at a tiny size: one app whose base carries the adapters and one of the adapters
merged as separate targets, on real Ray Serve; every request completes in both variants, and in float64 each request's
tokens are the same from both apps (the comparison itself catches a difference: the negative control)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import save_random_lora

from s2d_ray.bench.lora_serve import (
    LoraServeRun,
    compare,
    failures,
    measure,
    table,
    target_rss,
)

pytestmark = pytest.mark.serve


def test_adapters_and_merged_targets_serve_the_same_tokens(serve_instance, tiny_family, tmp_path):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_family["a"], dtype=torch.float64).eval()
    adapter = save_random_lora(base, tmp_path / "x", seed=1)
    run = LoraServeRun(target=str(tiny_family["a"]), draft=str(tiny_family["draft"]), adapter=[str(adapter)],
                       counts=[1, 2], requests=4, max_tokens=8, concurrency=2, warmup=1, dtype="float64",
                       replica_cpus=0.25, port=serve_instance, progress=False)
    report = measure(run)
    assert failures(report) == []
    assert [row["adapters"] for row in report["rows"]] == [1, 2]
    assert list(report["adapters"]) == ["x", "x-noisy1"]
    for row in report["rows"]:
        for kind in ("lora", "merged"):
            for variant in ("s2d", "plain"):
                got = row[kind][variant]
                assert got["completed"] == run.requests and got["output_tokens"] > 0
                assert sorted(got["token_ids"]) == list(range(run.requests))
            assert target_rss(row[kind]) > target_rss(row[kind], "anon") > 0  # its target replicas found and read
        for key, eq in row["equal"].items():
            assert eq == {"compared": run.requests, "equal": run.requests, "differ": []}, key
    # the merged app of 2 ran two target deployments; the adapters app one
    assert len([k for k in report["rows"][1]["merged"]["replica_rss_bytes"] if k.startswith("target")]) == 2
    assert len([k for k in report["rows"][1]["lora"]["replica_rss_bytes"] if k.startswith("target")]) == 1
    assert "| 2 |" in table(report)


def test_a_differing_request_is_reported():
    """Negative control: one request's tokens differ between the apps; the comparison names it."""
    def app(ids):
        return {v: {"token_ids": ids, "throughput_tokens_per_s": 1.0} for v in ("s2d", "plain")}

    same = {0: [1, 2], 1: [3, 4]}
    other = copy.deepcopy(same)
    other[1][1] = 5
    got = compare({"lora": app(same), "merged": app(other)}, 2)
    assert got["equal"]["lora=merged s2d"] == {"compared": 2, "equal": 1, "differ": [1]}
    assert got["equal"]["lora s2d=plain"]["differ"] == []
