"""Draft-length policies, config validation, and the rule that the core never imports Ray or pydantic."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from s2d_ray.config import DraftConfig, EngineConfig, SpecConfig
from s2d_ray.core.policy import FixedK, HeuristicK


def test_heuristic_policy_grows_on_full_acceptance_and_shrinks_otherwise():
    pol = HeuristicK(start=5, min_k=1, max_k=9)
    assert pol.initial() == 5
    assert pol.update(5, 5) == 7 and pol.update(7, 7) == 9 and pol.update(9, 9) == 9
    assert pol.update(2, 5) == 4 and pol.update(0, 1) == 1
    assert FixedK(3).update(0, 3) == 3


@pytest.mark.parametrize("bad", [
    dict(spec=dict(mode="fast")),
    dict(spec=dict(k=0)),
    dict(draft=dict(exit_layers=[4, 2])),
    dict(draft=dict(exit_layers=[2, 4], thresholds=[0.5])),
    dict(draft=dict(thresholds=[1.5])),
    dict(target=dict(dtype="int3")),
    dict(unknown_field=1),
])
def test_invalid_config_is_rejected_with_the_field_named(bad):
    with pytest.raises(ValidationError):
        EngineConfig.model_validate(bad)


def test_valid_config_and_fixed_exit_mode():
    cfg = EngineConfig.model_validate(dict(spec=dict(mode="exit:4"), draft=DraftConfig(exit_layers=[2, 4, 6]).model_dump()))
    assert cfg.spec.fixed_exit == 4 and SpecConfig().fixed_exit is None


def test_core_imports_neither_ray_nor_pydantic():
    code = (
        "import sys, s2d_ray.core.engine, s2d_ray.core.draft, s2d_ray.core.target, s2d_ray.core.sampling;"
        "bad = [m for m in ('ray', 'pydantic') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _draft_with_profile(tiny_llama_dir, tmp_path, profile: dict | None):
    """A saved 2-layer draft of the tiny model (exits 1, 2), with a committed-style profile for that target."""
    import json

    from s2d_ray.core.draft import SortedDraft
    from s2d_ray.models import load_model
    from s2d_ray.models.drafts import save_draft

    base = load_model(str(tiny_llama_dir))
    directory = tmp_path / "draft"
    save_draft(SortedDraft.cut(base.model, str(tiny_llama_dir), 2, [1, 2], [0.5, 0.0]), directory)
    if profile is not None:
        (directory / "calibration").mkdir()
        (directory / "calibration" / f"{tiny_llama_dir.name}.json").write_text(json.dumps(profile))
    return directory


def _built(tiny_llama_dir, directory, **spec):
    from s2d_ray.build import build_engine
    from s2d_ray.config import TargetConfig

    calibration = spec.pop("calibration", "auto")
    cfg = EngineConfig(target=TargetConfig(name=str(tiny_llama_dir), calibration=calibration),
                       draft=DraftConfig(source=str(directory)), spec=SpecConfig(**spec), num_threads=1)
    built = build_engine(cfg)
    return built.draft.spec.thresholds, built.engine.policy


def test_committed_profile_sets_thresholds_and_draft_length_unless_the_user_did(tiny_llama_dir, tmp_path, caplog):
    import json

    profile = {"exit_layers": [1, 2], "thresholds": [0.8, 0.0], "policy": "fixed", "k": 3,
               "modelled": {"speedup": 0.7}}
    directory = _draft_with_profile(tiny_llama_dir, tmp_path, profile)
    with caplog.at_level("WARNING"):
        assert _built(tiny_llama_dir, directory) == ([0.8, 0.0], FixedK(3))
    assert "0.70x" in caplog.text  # a profile that models a slowdown says so
    # What the user sets wins field by field; `off` ignores the profile.
    assert _built(tiny_llama_dir, directory, k=6)[1] == FixedK(6)
    assert _built(tiny_llama_dir, directory, policy="heuristic")[1] == HeuristicK(start=3, max_k=16)
    assert _built(tiny_llama_dir, directory, calibration="off") == ([0.5, 0.0], HeuristicK(start=5, max_k=16))
    # A profile measured in this dtype is preferred over the generic one.
    from s2d_ray.hardware import resolve_dtype

    dtype = resolve_dtype("auto")  # what the default dtype means on this machine
    (directory / "calibration" / f"{tiny_llama_dir.name}.{dtype}.json").write_text(json.dumps({**profile, "k": 2}))
    assert _built(tiny_llama_dir, directory)[1] == FixedK(2)
    # A profile for other exits does not apply its thresholds.
    other = _draft_with_profile(tiny_llama_dir, tmp_path / "o", {**profile, "exit_layers": [2]})
    assert _built(tiny_llama_dir, other)[0] == [0.5, 0.0]


def test_no_profile_means_the_drafts_own_settings_and_a_missing_path_is_an_error(tiny_llama_dir, tmp_path):
    from s2d_ray.errors import ConfigError

    directory = _draft_with_profile(tiny_llama_dir, tmp_path, None)
    assert _built(tiny_llama_dir, directory) == ([0.5, 0.0], HeuristicK(start=5, max_k=16))
    with pytest.raises(ConfigError, match="does not exist"):
        _built(tiny_llama_dir, directory, calibration=str(tmp_path / "nope.json"))


def test_profiles_record_data_files_relative_to_the_data_directory(tmp_path, monkeypatch):
    """Committed profiles name no machine's paths; the calibrate command writes them that way."""
    import json
    from pathlib import Path

    import s2d_ray.train.calibrate_cli as calibrate_cli
    from s2d_ray.build import COMMITTED_DRAFTS

    profiles = sorted(COMMITTED_DRAFTS.glob("*/calibration/*.json"))
    assert profiles
    for path in profiles:
        calibration_set = json.loads(path.read_text())["calibration_set"]
        assert not Path(calibration_set["file"]).is_absolute(), path
        assert not Path(calibration_set["paths"]).is_absolute(), path
    monkeypatch.setattr(calibrate_cli, "DATA_DIR", tmp_path / "data")
    assert calibrate_cli.data_relative(tmp_path / "data" / "train" / "x.jsonl") == "train/x.jsonl"
    assert calibrate_cli.data_relative(tmp_path / "elsewhere" / "y.jsonl") == "y.jsonl"
    assert calibrate_cli.data_relative(Path("rel/z.jsonl")) == "rel/z.jsonl"
