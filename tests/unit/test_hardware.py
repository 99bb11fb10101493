"""The one hardware module: the machine's name (CPU model and instruction set), `dtype: auto` resolved from the CPU's
flags or CUDA's bf16 support (config defaults, and the calibrated profile of the resolved dtype reaching a served
config that says nothing about speculation), and cost grids per machine: a profile records where its costs were
measured, carries other machines' beside them, and the engine prices speculation with this machine's."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

import s2d_ray.hardware as hardware
from s2d_ray.config import TargetConfig
from s2d_ray.core.costs import CostModel
from s2d_ray.core.policy import FixedK
from s2d_ray.hardware import (
    IdleCores, costs_machine, cpu_flags, cpu_model, for_machine, machine_name, resolve_dtype, store_costs,
)
from s2d_ray.serve.app_config import AppConfig, DraftDeploymentConfig

REPO = Path(__file__).resolve().parents[2]
INSTRUCT = "smollm2-135m-instruct"


def grid(one_row: float, wide: float) -> dict:
    return {"exit_token": [1.0, 2.0], "verify_grid": {"1": {"1": one_row, "32": wide}}}


def profile(machine: str | None) -> dict:
    measured = {"repeats": 3} | ({"machine": machine} if machine else {})
    return {"thresholds": [0.4, 0.0], "costs_ms": grid(30.0, 52.0), "costs_measured": measured}


def test_cpu_model_reads_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU @ 2GHz\nflags\t: avx\n")
    assert cpu_model(info) == "Some CPU @ 2GHz"
    assert machine_name("cpu").startswith(cpu_model())


def test_one_cpu_model_name_with_and_without_native_bf16_is_two_machines(monkeypatch):
    """Cloud CPUs report one model name ("AMD EPYC") for hosts with and without AVX512-BF16, where a bf16 grid
    differs by an order of magnitude: the instruction set is part of the name, so each host prices with its own
    grid."""
    monkeypatch.setattr(hardware, "cpu_model", lambda: "AMD EPYC")
    names = {}
    for label, flags in {"bf16": {"avx2", "avx512f", "avx512_bf16"}, "avx2": {"avx2", "fma"},
                         "amx": {"avx512_bf16", "amx_bf16", "amx_tile"}, "none": set()}.items():
        monkeypatch.setattr(hardware, "cpu_flags", lambda flags=flags: frozenset(flags))
        names[label] = machine_name("cpu")
    assert names == {"bf16": "AMD EPYC (avx512_bf16)", "avx2": "AMD EPYC (avx2)", "amx": "AMD EPYC (amx)",
                     "none": "AMD EPYC"}
    p = store_costs(profile(names["bf16"]), grid(100.0, 900.0), {"machine": names["avx2"]})
    assert for_machine(p, names["avx2"])["costs_ms"] == grid(100.0, 900.0)
    assert for_machine(p, names["bf16"])["costs_ms"] == grid(30.0, 52.0)


def test_a_profile_gives_this_machines_costs(caplog):
    p = store_costs(profile("AMD EPYC"), grid(100.0, 125.0), {"machine": "Intel Xeon", "repeats": 3})
    assert p["costs_ms"] == grid(30.0, 52.0)  # the top-level costs stay the machine they were measured on
    here = for_machine(p, "Intel Xeon")
    assert here["costs_ms"] == grid(100.0, 125.0) and costs_machine(here) == "Intel Xeon"
    assert here["thresholds"] == p["thresholds"] and p["costs_ms"] == grid(30.0, 52.0)  # a copy, p unchanged
    # The shape, not only the scale, follows the machine: 32 positions cost 1.25 one-row steps here, 1.73 there.
    assert CostModel.from_profile(here).verify(1, 32) / CostModel.from_profile(here).verify(1, 1) == 1.25
    with caplog.at_level(logging.WARNING, logger="s2d_ray.hardware"):
        assert for_machine(p, "AMD EPYC")["costs_ms"] == grid(30.0, 52.0)
        assert for_machine(profile(None), "Intel Xeon")["costs_ms"] == grid(30.0, 52.0)  # unrecorded: as it is
    assert not caplog.records


def test_costs_from_another_machine_warn_once(caplog):
    with caplog.at_level(logging.WARNING, logger="s2d_ray.hardware"):
        for _ in range(2):
            assert for_machine(profile("AMD EPYC"), "Other CPU", "p.json")["costs_ms"] == grid(30.0, 52.0)
    assert len(caplog.records) == 1
    assert "measured on AMD EPYC" in caplog.text and "--costs-only --profile p.json" in caplog.text


def test_store_costs_replaces_this_machines_or_unrecorded_costs():
    for before in ("Intel Xeon", None):
        p = store_costs(profile(before), grid(100.0, 125.0), {"machine": "Intel Xeon"})
        assert p["costs_ms"] == grid(100.0, 125.0) and costs_machine(p) == "Intel Xeon"
        assert "costs_by_machine" not in p


def test_calibrate_costs_only_adds_this_machine_beside_another(tmp_path, tiny_llama_dir):
    """`s2d calibrate --costs-only` on a profile measured elsewhere keeps those costs and adds this machine's, which
    the engine's profile loader then picks."""
    from s2d_ray.build import load_profile
    from s2d_ray.cli import main
    from s2d_ray.config import DraftConfig, EngineConfig, TargetConfig

    draft = f"cut:{tiny_llama_dir}:2:1,2"
    old = {"target": str(tiny_llama_dir), "draft": draft, "exit_layers": [1, 2], "thresholds": [0.4, 0.0],
           "policy": "fixed", "k": 3, "measured_with": "float64, 1 threads",
           "costs_ms": {"exit_token": [9.0, 9.0], "extra_head": 9.0, "verify": {"1": 9.0}},
           "costs_measured": {"machine": "A machine that is not this one"}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(old))
    assert main(["calibrate", "--costs-only", "--profile", str(path), "--threads", "1", "--context", "24",
                 "--repeats", "1"]) == 0
    new = json.loads(path.read_text())
    assert new["costs_ms"] == old["costs_ms"] and costs_machine(new) == "A machine that is not this one"
    mine = new["costs_by_machine"][machine_name()]
    assert mine["costs_measured"]["machine"] == machine_name() and list(mine["costs_ms"]["verify_grid"]) == [
        "1", "2", "4", "8", "16"]
    cfg = EngineConfig(target=TargetConfig(name=str(tiny_llama_dir), calibration=str(path)),
                       draft=DraftConfig(source=draft), num_threads=1)
    loaded = load_profile(cfg)
    assert loaded["costs_ms"] == mine["costs_ms"] and loaded["thresholds"] == [0.4, 0.0]
    assert CostModel.from_profile(loaded).verify(16, 32) == pytest.approx(mine["costs_ms"]["verify_grid"]["16"]["32"])


@pytest.fixture
def flags(monkeypatch):
    """Pretend the CPU has the given /proc/cpuinfo flags."""
    def set_flags(*names: str) -> None:
        monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(names))

    return set_flags


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile\n\n"
                    "processor\t: 1\nflags\t\t: fpu sse\n")
    assert cpu_flags(info) >= {"avx2", "avx512_bf16", "amx_tile"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


@pytest.mark.parametrize("present, expected", [
    ((), "float32"),
    (("avx2", "avx512f"), "float32"),  # AVX512 without BF16: bf16 matmuls are emulated, slower than fp32
    (("avx512f", "avx512_bf16"), "bfloat16"),
    (("amx_tile", "amx_bf16"), "bfloat16"),
])
def test_auto_on_cpu_is_bfloat16_only_with_native_bf16(flags, present, expected):
    flags(*present)
    assert resolve_dtype("auto") == expected
    assert resolve_dtype("auto", "cpu") == expected


def test_auto_on_cuda_follows_bf16_support_and_explicit_names_pass_through(flags, monkeypatch):
    flags()  # a CPU without bf16 does not matter for a CUDA replica
    monkeypatch.setattr(hardware, "cuda_has_bf16", lambda: True)
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    monkeypatch.setattr(hardware, "cuda_has_bf16", lambda: False)
    assert resolve_dtype("auto", "cuda") == "float32"
    for name in ("float32", "bfloat16", "float16", "float64"):
        assert resolve_dtype(name, "cpu") == resolve_dtype(name, "cuda") == name


def test_the_resolution_is_logged_once(flags, monkeypatch, caplog):
    monkeypatch.setattr(hardware, "_logged", set())
    flags("avx512_bf16")
    with caplog.at_level(logging.INFO, logger="s2d_ray.hardware"):
        for _ in range(3):
            resolve_dtype("auto")
    assert [r.getMessage() for r in caplog.records] == ["dtype auto -> bfloat16 on cpu (CPU flags avx512_bf16)"]


def test_auto_is_the_default_everywhere_and_bad_names_are_rejected():
    from s2d_ray.cli import build_parser

    assert TargetConfig().dtype == "auto" and DraftDeploymentConfig().dtype == "auto"
    assert AppConfig().targets[0].dtype == "auto"
    parser = build_parser()
    for argv in (["generate", "--prompt", "x"], ["bench", "spec"], ["bench", "steps"], ["calibrate", "--out", "p"]):
        assert parser.parse_args(argv).dtype == "auto"
    for bad in ("int8", "bf16", ""):
        with pytest.raises(ValidationError, match="dtype"):
            TargetConfig(dtype=bad)
        with pytest.raises(ValidationError, match="dtype"):
            AppConfig.model_validate({"draft": {"dtype": bad}})


def test_served_engine_configs_resolve_auto_for_the_replicas_device(flags, monkeypatch):
    flags()  # this CPU: float32
    monkeypatch.setattr(hardware, "cuda_has_bf16", lambda: True)
    cfg = AppConfig.model_validate({"targets": [
        {"name": "cpu"}, {"name": "gpu", "num_gpus": 1}, {"name": "tp", "tp_size": 2, "tp_worker_gpus": 1},
        {"name": "fixed", "dtype": "float64"}]})
    got = {t.name: cfg.engine_config(t.name).target.dtype for t in cfg.targets}
    assert got == {"cpu": "float32", "gpu": "bfloat16", "tp": "bfloat16", "fixed": "float64"}


def _local_yaml_engine(name: str):
    """The engine the router assembles for `name` from the shipped deployments/local.yaml (clients not called)."""
    from s2d_ray.build import assemble_engine, load_profile

    args = yaml.safe_load((REPO / "deployments" / "local.yaml").read_text())["applications"][0]["args"]
    cfg = AppConfig.model_validate(args)
    ecfg = cfg.engine_config(name)
    return ecfg, assemble_engine(ecfg, verifier=None, drafter=None, profile=load_profile(ecfg), max_context=None,
                                 detokenize=None)


@pytest.mark.parametrize("present, dtype, profile_file", [
    (("avx512_bf16",), "bfloat16", f"{INSTRUCT}.bfloat16.json"),
    ((), "float32", f"{INSTRUCT}.json"),
])
def test_local_yaml_says_nothing_about_speculation_so_the_profile_of_the_resolved_dtype_decides(
        flags, present, dtype, profile_file):
    from s2d_ray.build import COMMITTED_DRAFTS
    from s2d_ray.core.budget import TreeShape

    flags(*present)
    ecfg, engine = _local_yaml_engine(INSTRUCT)
    assert ecfg.target.dtype == dtype
    assert not {"policy", "k", "width", "lookup", "max_nodes"} & ecfg.spec.model_fields_set
    profile = json.loads((COMMITTED_DRAFTS / "smollm2-135m-s2d" / "calibration" / profile_file).read_text())
    # The profile's speculation shape and its measured costs (of THIS dtype) drive the engine.
    assert engine.policy == FixedK(profile["k"])  # auto's fallback when no costs; here costs exist
    assert engine.budget.shape == TreeShape(profile["width"], profile["lookup"], profile["max_nodes"])
    assert engine.budget.load_aware and profile["policy"] == "auto"
    grid = for_machine(profile, machine_name())["costs_ms"]["verify_grid"]  # this machine's, where it has them
    assert engine.budget.costs.verify(8, 4) == pytest.approx(grid["8"]["4"])


def test_a_served_spec_field_overrides_the_profile(flags):
    flags("avx512_bf16")
    from s2d_ray.build import effective_spec, load_profile

    cfg = AppConfig.model_validate({"targets": [{"name": INSTRUCT}], "spec": {"k": 4, "width": 2}})
    ecfg = cfg.engine_config(INSTRUCT)
    spec = effective_spec(ecfg, load_profile(ecfg))
    # k and width from the YAML; the policy and lookup still from the bf16 profile
    assert (spec.policy, spec.k, spec.width, spec.lookup) == ("auto", 4, 2, True)


def test_idle_cores_from_proc_stat_counters(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4\n")
    now = [0.0]
    reader = IdleCores(stat, min_interval=0.05, clock=lambda: now[0])
    reader.cores = 4
    # 100 more jiffies: 20 user, 5 system, 70 idle, 5 iowait -> 75% idle = 3 of 4 cores
    stat.write_text("cpu  120 0 55 870 55 0 0 0 0 0\n")
    assert reader() == 0.0  # too soon after the first look: the last value
    now[0] = 0.1
    assert reader() == 3.0
    stat.write_text("cpu  220 0 55 870 55 0 0 0 0 0\n")  # 100 jiffies all busy
    now[0] = 0.2
    assert reader() == 0.0
    assert IdleCores.here(stat) is not None
    stat.write_text("garbage\n")  # not Linux's format: no reader, so no idle cue
    assert IdleCores.here(stat) is None and IdleCores.here(tmp_path / "missing") is None


def test_a_record_names_the_data_directory_by_its_variable(monkeypatch):
    monkeypatch.setenv("S2D_DATA_DIR", "/srv/data/")
    argv = ["/opt/venv/bin/s2d", "bench", "serve", "--questions", "/srv/data/spec_bench/question.jsonl",
            "--out", "/srv/database/out"]
    assert hardware.recorded_argv(argv) == ["s2d", "bench", "serve", "--questions",
                                             "$S2D_DATA_DIR/spec_bench/question.jsonl", "--out", "/srv/database/out"]
    monkeypatch.delenv("S2D_DATA_DIR")
    assert hardware.recorded_argv(argv)[4] == "/srv/data/spec_bench/question.jsonl"
