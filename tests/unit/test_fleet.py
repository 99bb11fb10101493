"""The fleet capacity model's arithmetic (not its timings): shapes, roofline, MAT, draft length choice, fleet sums."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from s2d_ray.cli import main
from s2d_ray.fleet.hardware import Device
from s2d_ray.fleet.model import Replica, forward_ms, mat
from s2d_ray.fleet.plan import plan
from s2d_ray.fleet.shapes import SHAPES, ModelShape, known_shape

GPU_YAML = Path(__file__).parents[2] / "deployments" / "gpu.yaml"
UNIT = Device("unit", bandwidth_gbs=1.0, tflops=1.0, memory_gb=80, bandwidth_eff=1.0, flops_eff=1.0,
              layer_overhead_ms=0.0, forward_overhead_ms=0.0, row_overhead_ms=0.0, round_overhead_ms=0.0,
              round_row_overhead_ms=0.0, draft_depth_overhead_ms=0.0, spec_round_overhead_ms=0.0,
              spec_row_overhead_ms=0.0)


def test_shapes_match_the_published_parameter_counts():
    # Llama-2-7B: 6,738,415,616 parameters, of which 266,240 are norm weights (not modelled).
    assert SHAPES["llama-2-7b"].params() == 6_738_415_616 - 266_240
    assert SHAPES["llama-2-70b"].params() == pytest.approx(68.98e9, rel=2e-3)
    rank = SHAPES["llama-2-70b"].shard(4)
    assert (rank.heads, rank.kv_heads, rank.intermediate, rank.vocab) == (16, 2, 7168, 8000)
    assert rank.layer_params * 4 == SHAPES["llama-2-70b"].layer_params  # every matmul splits evenly
    with pytest.raises(ValueError, match="divide"):
        SHAPES["llama-2-70b"].shard(3)
    assert known_shape("/mnt/models/vicuna-13b-v1.5") == SHAPES["llama-2-13b"]
    assert known_shape("/mnt/models/Llama-2-70b-chat-hf") == SHAPES["llama-2-70b"]


def test_roofline_is_the_slower_of_memory_and_compute_plus_overheads():
    s = ModelShape("s", layers=2, hidden=1000, intermediate=1000, heads=10, kv_heads=10, head_dim=100, vocab=1000)
    weights = 2 * (2 * s.layer_params + 1000 * 1000)  # bf16 bytes: 2 layers + head
    kv = 4 * 100 * 2 * 2 * 10 * 100 * 2  # rows x context x (k, v) x layers x kv heads x head_dim x 2 bytes
    assert forward_ms(s, UNIT, 4, 1, 100) == pytest.approx(1e3 * (weights + kv) / 1e9)  # decode: memory-bound
    flops = s.forward_flops(64, 64, 0)  # 64 rows x 64 positions, no cached context
    assert flops == 4096 * (2 * (2 * s.layer_params + 4 * 10 * 100 * 64) + 2 * 1000 * 1000)  # 2 layers + head
    assert forward_ms(s, UNIT, 64, 64, 0) == pytest.approx(1e3 * flops / 1e12)  # wide: compute-bound
    slow = Device(**{**UNIT.__dict__, "layer_overhead_ms": 0.5, "forward_overhead_ms": 0.25, "row_overhead_ms": 0.1})
    assert forward_ms(s, slow, 4, 1, 100) == pytest.approx(forward_ms(s, UNIT, 4, 1, 100) + 2 * 0.5 + 0.25 + 3 * 0.1)
    # One CPU core: the weight stream pays for one token per row; every further token adds its FLOPs.
    core = Device(**{**UNIT.__dict__, "overlap": False})
    extra = s.forward_flops(4, 3, 100) - 4 * s.forward_flops(1, 1, 100)
    assert forward_ms(s, core, 4, 3, 100) == pytest.approx(1e3 * (weights + kv) / 1e9 + 1e3 * extra / 1e12)
    assert forward_ms(s, core, 4, 1, 100) == pytest.approx(forward_ms(s, UNIT, 4, 1, 100))


def test_mat_and_the_draft_length_that_pays():
    assert mat(0.5, 0) == 1.0 and mat(0.5, 1) == 1.5 and mat(0.5, 3) == pytest.approx(1.875) and mat(1.0, 4) == 5
    target, draft = SHAPES["llama-2-7b"], SHAPES["llama-2-7b"].with_layers(2)
    h100 = Device("h100", 3350, 989, 80)
    rep = Replica(target, h100, draft=draft, agree=0.8)
    assert rep.best_k(1) >= 3  # weight-bound at batch 1: verifying k + 1 positions costs about one step
    assert rep.best_k(512) < rep.best_k(1)  # compute-bound under load: speculation shrinks...
    assert Replica(target, h100, draft=target, agree=0.3).best_k(1) == 0  # ...and a draft as dear as the target never pays
    # Tokens/s is batch x MAT over the round, and a shared draft takes drafting off the target's GPU.
    assert rep.tokens_per_s(8, 3) == pytest.approx(1e3 * 8 * mat(0.8, 3) / rep.round_ms(8, 3))
    assert rep.round_ms(8, 3) - rep.round_ms(8, 3, draft_elsewhere=True) == pytest.approx(3 * rep.draft_ms(8))
    # Engine overheads: per round and per extra row, and what a speculative round adds (k > 0 only).
    busy = Replica(target, Device(**{**h100.__dict__, "round_overhead_ms": 1.0, "round_row_overhead_ms": 0.1,
                                     "spec_round_overhead_ms": 2.0, "spec_row_overhead_ms": 0.5}), draft=draft)
    assert busy.round_ms(8, 0) - busy.verify_ms(8, 1) == pytest.approx(1.0 + 7 * 0.1)
    assert busy.round_ms(8, 2) - busy.verify_ms(8, 3) - 2 * busy.draft_ms(8) == pytest.approx(1.7 + 2.0 + 7 * 0.5)


def test_plan_of_the_gpu_fleet_adds_up():
    r = plan(GPU_YAML, Device("h100", 3350, 989, 80), rate=4.0, agree=0.7)
    assert [t["target"] for t in r["targets"]] == ["vicuna-7b-v1.5", "vicuna-13b-v1.5", "llama-2-70b-chat"]
    for t in r["targets"]:
        none, own, shared = t["fleets"]["none"], t["fleets"]["per_target"], t["fleets"]["shared"]
        assert none["k"] == 0 and none["mat"] == 1.0
        for f in (none, own, shared):
            assert f["replicas"] * f["tokens_per_s_per_replica"] >= t["need_tokens_per_s"]
            assert f["target_gpus"] == f["replicas"] * t["tp"]
            assert f["tokens_per_s_per_target_gpu"] == pytest.approx(f["tokens_per_s_per_replica"] / t["tp"], abs=0.1)
        assert own["tokens_per_s_per_replica"] > none["tokens_per_s_per_replica"]  # agreement 0.7 pays
        assert t["costs_ms"]["verify"]["1"]["1"] == t["costs_ms"]["step"]["1"]
    assert r["targets"][2]["tp"] == 4 and r["targets"][2]["memory_gb_per_gpu"]["fits"]
    totals = r["totals"]
    for name, tot in totals.items():
        assert tot["gpus"] == tot["target_gpus"] + tot["draft_gpus"]
        assert tot["target_gpus"] == sum(t["fleets"][name]["target_gpus"] for t in r["targets"])
    assert (totals["per_target"]["draft_training_runs"], totals["shared"]["draft_training_runs"]) == (3, 1)
    assert totals["shared"]["draft_weights_gb"] < totals["per_target"]["draft_weights_gb"]
    assert r["draft"]["depth"] == 12 and r["draft"]["shape"]["layers"] == 12


def test_plan_cli_prints_json_and_rejects_bad_input(capsys):
    assert main(["plan", str(GPU_YAML), "--json", "--device", "a100", "--rate", "2"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["device"]["name"] == "a100" and set(r["totals"]) == {"none", "per_target", "shared"}
    assert "smollm2-135m-instruct.bfloat16.json" in r["agree_source"]
    assert main(["plan", str(GPU_YAML), "--agree", "1.5"]) == 2
    assert main(["plan", "missing.yaml"]) == 2
    err = capsys.readouterr().err
    assert "--agree must be in [0, 1)" in err and "missing.yaml does not exist" in err


def test_cross_node_calls_add_latency_not_gpu_time(capsys):
    from s2d_ray.fleet.model import CROSS_NODE_MS

    target = SHAPES["llama-2-7b"]
    rep = Replica(target, Device("h100", 3350, 989, 80), draft=target.with_layers(2), agree=0.6, cross_node_ms=5.0)
    # A shared draft elsewhere: the router calls it and the target every drafting round; plain rounds call the target.
    assert rep.latency_ms(8, 4, draft_elsewhere=True) == pytest.approx(rep.round_ms(8, 4) + 2 * 5.0)
    assert rep.latency_ms(8, 0, draft_elsewhere=True) == pytest.approx(rep.round_ms(8, 0) + 5.0)
    assert rep.latency_ms(8, 4) == pytest.approx(rep.round_ms(8, 4) + 5.0)  # its own draft: one call
    near, far = (plan(GPU_YAML, rep.dev, 4.0, agree=0.6, cross_node_ms=ms) for ms in (0.0, 5.0))
    for a, b in zip(near["targets"], far["targets"]):
        for fleet in ("none", "per_target", "shared"):
            fa, fb = a["fleets"][fleet], b["fleets"][fleet]
            assert (fa["k"], fa["target_gpus"]) == (fb["k"], fb["target_gpus"])  # GPU time unchanged
            assert fb["latency_ms_per_token"] == pytest.approx(
                fa["latency_ms_per_token"] + fb["calls_per_round"] * 5.0 / fb["mat"], abs=0.02)
    assert main(["plan", str(GPU_YAML), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cross_node_ms"] == CROSS_NODE_MS  # the measured default
    assert main(["plan", str(GPU_YAML), "--cross-node-ms", "-1"]) == 2


def test_plan_check_prediction_with_a_measured_mat():
    from s2d_ray.bench.plan_check import predict

    s = SHAPES["smollm2-135m"]
    rep = Replica(s, UNIT, draft=s.with_layers(6), agree=0.4)
    prefill = forward_ms(s, UNIT, 8, 50, 0) + forward_ms(s.with_layers(6), UNIT, 8, 50, 0)  # target, then draft
    at = replace(rep, context=40 + 32)  # mean prompt + half the new tokens
    group = [40, 30, 50, 40, 40, 40, 40, 40]  # prefill as wide as the longest prompt
    assert predict(rep, [group], 2, 64) == pytest.approx(1e3 * 8 * 64 / (prefill + 64 / mat(0.4, 2) * at.round_ms(8, 2)))
    assert predict(rep, [group], 2, 64, 2.5) == pytest.approx(1e3 * 8 * 64 / (prefill + 64 / 2.5 * at.round_ms(8, 2)))
    one = forward_ms(s, UNIT, 1, 50, 0) + 64 * replace(rep, context=50 + 32).round_ms(1, 0)
    two = forward_ms(s, UNIT, 1, 30, 0) + 64 * replace(rep, context=30 + 32).round_ms(1, 0)
    assert predict(rep, [[50], [30]], 0, 64) == pytest.approx(1e3 * 2 * 64 / (one + two))  # batches in turn


def test_plan_check_runs_end_to_end_on_a_tiny_model(tiny_llama_dir, tmp_path, capsys):
    """The bench command's plumbing (timings are not asserted): every (mode, batch) row, errors = predicted / measured
    - 1, and the draft's measured MAT reaches the second S2D prediction."""
    questions = tmp_path / "question.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": task, "turns": [f"Tell me about {task}."]})
                                 + "\n" for i, task in enumerate(("writing", "qa", "translation"))))
    rc = main(["bench", "plan-check", "--target", str(tiny_llama_dir), "--draft", f"cut:{tiny_llama_dir}:1",
               "--dtype", "float32", "--tokens", "6", "--batches", "1,2", "--repeats", "1", "--quick",
               "--prompts", "specbench", "--data", str(questions), "--out", str(tmp_path)])
    assert rc == 0
    r = json.loads((tmp_path / "plan_check.json").read_text())
    assert [(row["mode"], row["batch"]) for row in r["rows"]] == [("ar", 1), ("s2d", 1), ("ar", 2), ("s2d", 2)]
    for row in r["rows"]:
        assert row["error"] == pytest.approx(row["predicted_tps"] / row["measured_tps"] - 1)
        assert row["measured_tps"] > 0 and row["predicted_tps"] > 0
    s2d = r["rows"][1]
    assert s2d["measured_mat"] >= 1 and "predicted_tps_measured_mat" in s2d
    assert r["device_measured"]["bandwidth_gbs"] > 0 and r["device_measured"]["layer_overhead_ms"] >= 0
    assert "Largest error" in capsys.readouterr().out


def test_gpu_check_runs_are_priced_by_their_own_device_row():
    """`s2d bench plan-check --gpu-json`: a graphed run's row prices its graphed rounds only (an eager round costs
    host launches the graphed row never saw); trees are not in the model; errors are prediction / measurement - 1."""
    import json
    from pathlib import Path

    from s2d_ray.bench.plan_check import gpu_errors, gpu_markdown

    root = Path(__file__).resolve().parents[2] / "bench_results"
    graphed = json.loads((root / "gpu-rounds" / "gpu_check.json").read_text())
    rows = gpu_errors(graphed)
    assert {(r["mode"], r["batch"]) for r in rows} == {(m, b) for m in ("ar+graphs", "s2d+graphs") for b in (1, 8)}
    for r in rows:
        assert r["error"] == pytest.approx(r["predicted_tps"] / r["measured_tps"] - 1)
        assert r["measured_tps"] == graphed["engine"][str(r["batch"])][r["mode"]]["tokens_per_s"]
    eager = gpu_errors(json.loads((root / "plan-check" / "gpu_check_eager_row.json").read_text()))
    assert {r["mode"] for r in eager} == {"ar", "s2d"}
    assert "| ar+graphs | 1 |" in gpu_markdown(graphed, rows)
