"""Cost grids are per machine: a profile records where its costs were measured, carries other machines' beside them,
and the engine prices speculation with this machine's."""

from __future__ import annotations

import json
import logging

import pytest

from s2d_ray.core.costs import CostModel
from s2d_ray.machines import costs_machine, cpu_model, for_machine, machine_name, store_costs


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
    differs ~10x: the instruction set is part of the name, so each host prices with its own grid."""
    from s2d_ray import dtypes, machines

    monkeypatch.setattr(machines, "cpu_model", lambda: "AMD EPYC")
    names = {}
    for label, flags in {"bf16": {"avx2", "avx512f", "avx512_bf16"}, "avx2": {"avx2", "fma"},
                         "amx": {"avx512_bf16", "amx_bf16", "amx_tile"}, "none": set()}.items():
        monkeypatch.setattr(dtypes, "cpu_flags", lambda flags=flags: frozenset(flags))
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
    with caplog.at_level(logging.WARNING, logger="s2d_ray.machines"):
        assert for_machine(p, "AMD EPYC")["costs_ms"] == grid(30.0, 52.0)
        assert for_machine(profile(None), "Intel Xeon")["costs_ms"] == grid(30.0, 52.0)  # unrecorded: as it is
    assert not caplog.records


def test_costs_from_another_machine_warn_once(caplog):
    with caplog.at_level(logging.WARNING, logger="s2d_ray.machines"):
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
