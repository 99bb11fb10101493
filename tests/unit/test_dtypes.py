"""`dtype: auto`: one resolution function (CPU flags / CUDA bf16), config defaults, and the calibrated profile of the
resolved dtype reaching a served config that says nothing about speculation."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

import s2d_ray.dtypes as dtypes
from s2d_ray.config import TargetConfig
from s2d_ray.core.policy import FixedK, HeuristicK
from s2d_ray.dtypes import cpu_flags, resolve_dtype
from s2d_ray.serve.app_config import AppConfig, DraftDeploymentConfig

REPO = Path(__file__).resolve().parents[2]
INSTRUCT = "smollm2-135m-instruct"


@pytest.fixture
def flags(monkeypatch):
    """Pretend the CPU has the given /proc/cpuinfo flags."""
    def set_flags(*names: str) -> None:
        monkeypatch.setattr(dtypes, "cpu_flags", lambda: frozenset(names))

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
    monkeypatch.setattr(dtypes, "cuda_has_bf16", lambda: True)
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    monkeypatch.setattr(dtypes, "cuda_has_bf16", lambda: False)
    assert resolve_dtype("auto", "cuda") == "float32"
    for name in ("float32", "bfloat16", "float16", "float64"):
        assert resolve_dtype(name, "cpu") == resolve_dtype(name, "cuda") == name


def test_the_resolution_is_logged_once(flags, monkeypatch, caplog):
    monkeypatch.setattr(dtypes, "_logged", set())
    flags("avx512_bf16")
    with caplog.at_level(logging.INFO, logger="s2d_ray.dtypes"):
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
    monkeypatch.setattr(dtypes, "cuda_has_bf16", lambda: True)
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
    import json

    from s2d_ray.build import COMMITTED_DRAFTS
    from s2d_ray.core.budget import TreeShape
    from s2d_ray.machines import for_machine, machine_name

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
