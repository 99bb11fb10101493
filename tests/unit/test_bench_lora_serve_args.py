"""`s2d bench lora-serve` without Serve: the two apps it deploys are valid app configs that differ only where they
should (one base carrying N adapters against N merged targets on the base's profile), and bad settings stop with one
line before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from s2d_ray.bench.lora_serve import COMMITTED, LoraServeRun, adapter_names, app_args
from s2d_ray.cli import main
from s2d_ray.serve.app_config import AppConfig
from s2d_ray.serve.lora_config import adapter_path


def test_the_two_apps_differ_only_in_their_targets(tmp_path):
    run = LoraServeRun(concurrency=4, max_tokens=32)
    paths = [adapter_path(a) for a in COMMITTED]
    names = adapter_names(COMMITTED, paths + [tmp_path / "a2"])
    assert names == [*COMMITTED, f"{COMMITTED[0]}-noisy2"]
    adapters = dict(zip(names[:2], paths))
    lora = app_args(run, "lora", adapters, tmp_path, "profile.json")
    merged = app_args(run, "merged", adapters, tmp_path, "profile.json")
    assert {k: v for k, v in lora.items() if k not in ("targets", "draft")} == \
        {k: v for k, v in merged.items() if k not in ("targets", "draft")}
    (base,) = lora["targets"]
    assert base["source"] == run.target and base["lora"]["adapters"] == {k: str(v) for k, v in adapters.items()}
    assert base["lora"]["max_loaded"] == 2 and "calibration" not in base  # auto: the base's own profile
    assert [(t["name"], t["source"], t["calibration"]) for t in merged["targets"]] == [
        (n, str(tmp_path / n), "profile.json") for n in names[:2]]
    assert merged["draft"]["max_batch_size"] == 2 and lora["draft"]["max_batch_size"] == 1
    assert lora["limits"]["max_total_tokens"] == 512 + 32
    cfg = AppConfig.model_validate(lora)  # the adapters app as Serve would read it
    assert list(cfg.target(run.target).lora.adapters) == names[:2]


@pytest.mark.parametrize("args, message", [
    (["--adapters", "0,2"], "--adapters: a comma list of counts >= 1"),
    (["--requests", "0"], "must be >= 1"),
    (["--replica-cpus", "0"], "--replica-cpus and --timeout must be positive"),
    (["--adapter", "/nonexistent/adapter"], "--adapter /nonexistent/adapter: not a peft adapter directory"),
    (["--adapter", COMMITTED[0], "--adapter", COMMITTED[0]], "these repeat"),
])
def test_bad_arguments_are_one_line(capsys, args, message):
    assert main(["bench", "lora-serve", *args, "--out", str(Path("/nonexistent/never-written"))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
