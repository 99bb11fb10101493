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
