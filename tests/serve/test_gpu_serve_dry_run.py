"""`s2d bench gpu-serve` known to work end to end before it meets a GPU: its --tiny dry run serves the same Serve app
(router, a random-init target built from its config, a draft cut from it) on the CPU, and S2D == AR at every level;
without a GPU the real run stops with one line."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from s2d_ray.bench.gpu_serve import PHASES, failures, markdown, require_gpu, run, tiny_run
from s2d_ray.errors import ConfigError

pytestmark = pytest.mark.serve


def test_without_a_gpu_the_run_stops_with_one_line():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(ConfigError, match="needs a CUDA GPU.*--tiny"):
        require_gpu(tiny=False)
    assert require_gpu(tiny=True) == "cpu"


def test_dry_run_serves_every_level_with_s2d_equal_to_ar(serve_instance, tmp_path):
    # the float32 phase only: the bfloat16 one is the same code in another dtype, and a deployment costs seconds
    cfg = replace(tiny_run(tmp_path, serve_instance), phases=PHASES[:1])
    result = run(cfg)
    assert failures(result) == []
    for label, phase in result["phases"].items():
        assert {(r["concurrency"], r["variant"]) for r in phase["summary"]} == {
            (c, v) for c in cfg.concurrency for v in ("speculative", "plain")}
        assert all(r["completed"] == cfg.requests and r["output_tokens"] > 0 for r in phase["summary"])
        for c in cfg.concurrency:
            assert phase["equal"][str(c)]["compared"] == cfg.requests
        assert phase["devices"]["target"]["device"] == "cpu"
        assert phase["devices"]["target"]["dtype"] == phase["dtype"]
        assert phase["devices"]["draft"]["dtype"] == phase["dtype"]
        assert phase["devices"]["router"] == {"device": "cpu", "dtype": None}
    eq = result["phases"]["equality"]
    assert eq["dtype"] == "float32" and all(e["differ"] == [] for e in eq["equal"].values())
    assert "| 4 |" in markdown(result) and (tmp_path / "gpu_serve.json").is_file()


def test_failures_catch_a_difference_in_float32():
    """Negative control: one differing float32 response fails the run; in bfloat16 it is reported only."""
    row = {"concurrency": 1, "variant": "speculative", "errors": 0, "completed": 1, "error_samples": []}
    phase = {"summary": [row], "equal": {"1": {"compared": 2, "equal": 1, "differ": [1]}}}
    assert failures({"phases": {"equality": {**phase, "dtype": "float32"}}}) == [
        "equality c=1: S2D != AR for prompts [1]"]
    assert failures({"phases": {"speed": {**phase, "dtype": "bfloat16"}}}) == []
