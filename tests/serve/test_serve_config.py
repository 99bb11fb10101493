"""Every deployment YAML passes Serve's own schema and our AppConfig, binds into an application with the intended
deployments; cluster.yaml passes Ray's cluster-launcher validation. No Ray cluster needed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from s2d_ray.serve import AppConfig, build_app
from s2d_ray.serve.deployment_options import IN_LOOP_ENV

REPO = Path(__file__).resolve().parents[2]
DEPLOYMENT_YAMLS = sorted((REPO / "deployments").glob("*.yaml"))


def test_there_are_local_and_gpu_configs():
    assert {p.name for p in DEPLOYMENT_YAMLS} >= {"local.yaml", "gpu.yaml"}


@pytest.mark.parametrize("path", DEPLOYMENT_YAMLS, ids=[p.name for p in DEPLOYMENT_YAMLS])
def test_deployment_yaml_is_valid_for_serve_and_for_us(path):
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load(path.read_text())
    schema = ServeDeploySchema.model_validate(raw)
    assert schema.applications
    for app in schema.applications:
        assert app.import_path == "s2d_ray.serve:build_app"
        cfg = AppConfig.model_validate(app.args)
        names = [d.name for d in _deployments(build_app(app.args))]
        expected = {"router", "metrics", *(f"target-{t.name}" for t in cfg.deployed_targets)}  # placed: in the router
        expected |= {"draft"} if cfg.draft_deployment else set()
        expected |= {"lora-registry"} if any(t.lora for t in cfg.targets) else set()  # runtime adapter loads
        assert set(names) == expected


def _deployments(application) -> list:
    """The finalized deployments, built the way `serve run` builds them (handles injected, names checked)."""
    from ray.serve._private.build_app import build_app as serve_build

    return serve_build(application, name="check").deployments


def test_router_lets_streams_finish_on_scale_down():
    args = {"targets": [{"name": "t", "source": "hf-internal-testing/tiny-random-LlamaForCausalLM"}],
            "spec": {"mode": "ar"}, "limits": {"request_timeout_s": 123}}
    by_name = {d.name: d for d in _deployments(build_app(args))}
    assert by_name["router"]._deployment_config.graceful_shutdown_timeout_s == 123
    args["router"] = {"graceful_shutdown_timeout_s": 7}
    by_name = {d.name: d for d in _deployments(build_app(args))}
    assert by_name["router"]._deployment_config.graceful_shutdown_timeout_s == 7


def test_every_deployment_runs_in_loop_unless_told_otherwise():
    """serve_in_loop puts Serve's in-loop switches in each deployment's runtime_env; a value the config sets for one
    deployment wins, its other runtime_env keys stay, and serve_in_loop: false leaves the options as they were."""
    args = {"targets": [{"name": "t", "source": "hf-internal-testing/tiny-random-LlamaForCausalLM",
                         "ray_actor_options": {"runtime_env": {"env_vars": {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1",
                                                                            "X": "y"}, "pip": ["six"]}}}]}
    envs = {d.name: d.ray_actor_options.get("runtime_env", {}) for d in _deployments(build_app(args))}
    assert set(envs) == {"router", "draft", "target-t", "metrics"}
    for name in ("router", "draft", "metrics"):
        assert envs[name] == {"env_vars": IN_LOOP_ENV}
    assert envs["target-t"] == {"pip": ["six"], "env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                                                             "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1", "X": "y"}}
    args["serve_in_loop"] = False
    envs = {d.name: d.ray_actor_options.get("runtime_env", {}) for d in _deployments(build_app(args))}
    assert envs == {"router": {}, "draft": {}, "metrics": {}, "target-t": {"env_vars": {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1",
                                                                          "X": "y"}, "pip": ["six"]}}


def test_gpu_yaml_describes_the_fleet():
    app = yaml.safe_load((REPO / "deployments" / "gpu.yaml").read_text())["applications"][0]
    cfg = AppConfig.model_validate(app["args"])
    by_name = {t.name: t for t in cfg.targets}
    assert set(by_name) == {"vicuna-7b-v1.5", "vicuna-13b-v1.5", "llama-2-70b-chat"}
    big = by_name["llama-2-70b-chat"]
    assert big.tp_size == 4 and big.tp_worker_gpus == 1
    placement = big.placement_group()
    assert placement["placement_group_strategy"] == "STRICT_PACK"
    assert len(placement["placement_group_bundles"]) == 5  # the replica + 4 ranks
    assert all(b.get("GPU") == 1 for b in placement["placement_group_bundles"][1:])
    assert all(t.autoscaling_config for t in cfg.targets) and cfg.draft.autoscaling_config
    assert {t.dtype for t in cfg.targets} == {"bfloat16"}


def test_local_yaml_fits_a_two_cpu_ray():
    app = yaml.safe_load((REPO / "deployments" / "local.yaml").read_text())["applications"][0]
    cfg = AppConfig.model_validate(app["args"])
    cpus = cfg.router.num_cpus + (cfg.draft.num_cpus if cfg.draft_deployment else 0.0)
    for t in cfg.deployed_targets:  # a target placed in the router works on the router's CPUs
        cpus += t.num_cpus + (t.tp_worker_cpus * t.tp_size if t.tp_size > 1 else 0)
    assert cpus <= 2.0
    assert any(t.tp_size == 3 for t in cfg.targets)


def test_a_router_never_decodes_more_sequences_than_a_replica_keeps_rows_for():
    """Unset rows follow the admission (local.yaml's 64-sequence target keeps 64 rows; the draft the sum over the
    targets); rows set lower cap the admission. A router decoding 64 sequences on 32 rows reclaimed rows every round
    and each reclaimed sequence recomputed its context."""
    app = yaml.safe_load((REPO / "deployments" / "local.yaml").read_text())["applications"][0]
    cfg = AppConfig.model_validate(app["args"])
    for t in cfg.targets:
        assert t.max_live_sequences == max(32, t.max_concurrent_sequences)
        assert cfg.max_sequences(t.name) == t.max_concurrent_sequences
    assert cfg.max_sequences("smollm2-135m-instruct") == cfg.target("smollm2-135m-instruct").max_live_sequences == 64
    assert cfg.draft.max_live_sequences == sum(cfg.max_sequences(t.name) for t in cfg.targets) == 68
    capped = AppConfig.model_validate({"targets": [{"name": "a", "max_concurrent_sequences": 64,
                                                    "max_live_sequences": 16}], "draft": {"max_live_sequences": 8}})
    assert capped.max_sequences("a") == 16
    assert capped.draft.max_live_sequences == 8  # what the config says stays
    plain = AppConfig.model_validate({})
    assert plain.targets[0].max_live_sequences == 32 and plain.max_sequences(plain.targets[0].name) == 8


def test_cluster_yaml_passes_ray_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((REPO / "cluster.yaml").read_text())
    validate_config(prepare_config(raw))
    types = raw["available_node_types"]
    gpu_types = [t for t in types.values() if t.get("resources", {}).get("GPU")]
    assert len(gpu_types) >= 2 and all("max_workers" in t for t in gpu_types)
    assert any("s2d" in cmd and ".whl" in cmd for cmd in raw["setup_commands"])


@pytest.mark.parametrize("args, needle", [
    ({"targets": [{"name": "a"}, {"name": "a"}]}, "unique"),
    ({"targets": []}, "at least 1"),
    ({"targets": [{"name": "a", "tp_size": 2, "dtype": "float64"}]}, "float64"),
    ({"targets": [{"name": "a", "num_replicas": 2, "autoscaling_config": {"max_replicas": 3}}]}, "either"),
    ({"targets": [{"name": "a", "colour": "blue"}]}, "colour"),
    ({"spec": {"mode": "fast"}}, "mode"),
    ({"draft": {"exit_layers": [4, 2]}}, "increasing"),
    ({"draft": {"placement": "router", "autoscaling_config": {"max_replicas": 2}}}, "autoscaling_config would not"),
    ({"draft": {"placement": "gpu"}}, "placement"),
    ({"limits": {"max_queued_requests": -1}}, "max_queued_requests"),
])
def test_bad_app_config_names_the_problem(args, needle):
    with pytest.raises(ValidationError, match=needle):
        AppConfig.model_validate(args)


def test_api_key_is_never_shown():
    cfg = AppConfig.model_validate({"api_key": "s3cret-value"})
    assert "s3cret-value" not in repr(cfg) and "s3cret-value" not in str(cfg.model_dump())
    assert cfg.api_key.get_secret_value() == "s3cret-value"


def test_target_calibration_gives_that_target_its_own_thresholds(tiny_family, tmp_path):
    """One shared draft; a target with a calibration profile drafts with its thresholds (per row, in the shared
    drafter), the others with the draft's; only other exit LAYERS get a drafter of their own."""
    import json

    from s2d_ray.serve.draft_deployment import load_shared_draft, per_target_drafters

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"exit_layers": [1, 2, 3], "thresholds": [0.9, 0.7, 0.0]}))
    same_as_draft = tmp_path / "same.json"
    same_as_draft.write_text(json.dumps({"exit_layers": [1, 2, 3], "thresholds": [0.05, 0.05, 0.0]}))
    cfg = AppConfig.model_validate({
        "targets": [{"name": "a", "source": str(tiny_family["a"]), "dtype": "float64"},
                    {"name": "b", "source": str(tiny_family["b"]), "dtype": "float64", "calibration": str(profile)},
                    {"name": "c", "source": str(tiny_family["b"]), "dtype": "float64", "calibration": str(profile)},
                    {"name": "d", "source": str(tiny_family["b"]), "dtype": "float64",
                     "calibration": str(same_as_draft)}],
        "draft": {"source": str(tiny_family["draft"]), "dtype": "float64"},
    })
    draft = load_shared_draft(cfg)
    assert draft.spec.thresholds == [0.05, 0.05, 0.0]
    drafters, thresholds = per_target_drafters(cfg, draft)
    assert thresholds == {"b": (0.9, 0.7, 0.0), "c": (0.9, 0.7, 0.0)}  # d equals the draft's own: nothing to stamp
    assert drafters == {}  # thresholds alone never force a drafter (and so a forward) of their own


def test_decode_loop_does_not_run_under_the_request_context_that_started_it():
    """Serve ties calls made under a request's context to that request (and cancelled them when it ended: a soak
    leaked a target KV row through a cancelled release). The loop must make its calls under no request's context."""
    import asyncio

    from ray.serve import context as serve_context

    from core_fixtures import random_prompts, tiny_target
    from s2d_ray.core.engine import GenerationRequest, SpecEngine
    from s2d_ray.core.target import TargetVerifier
    from s2d_ray.serve.metrics import ServeMetrics
    from s2d_ray.serve.scheduler import TargetScheduler

    verifier = TargetVerifier(tiny_target())
    seen: list[str | None] = []

    class LocalTarget:  # the transport only: scores with the real verifier, notes the Serve request context
        async def score(self, requests):
            seen.append(serve_context._get_serve_request_context().request_id)
            return verifier.score(requests)

        def release(self, seq_id):
            seen.append(serve_context._get_serve_request_context().request_id)
            verifier.release(seq_id)

    target = LocalTarget()
    sched = TargetScheduler("t", SpecEngine(target), 4, 4, ServeMetrics())

    async def handler() -> list[int]:
        serve_context._set_request_context(request_id="first-http-request")
        queue = sched.submit(GenerationRequest("s", random_prompts(1)[0], 3))
        tokens = []
        while not (event := await queue.get()).finished:
            tokens += event.tokens
        return tokens + event.tokens

    assert len(asyncio.run(handler())) == 3
    assert seen and "first-http-request" not in seen


def test_kernel_settings_reach_every_replicas_engine_config(monkeypatch):
    """The served app's CPU kernel settings are config fields, handed to each target's EngineConfig (from which the
    replicas build their kernels); a value outside the choices is refused by name."""
    from s2d_ray.build import make_kernels

    monkeypatch.delenv("S2D_LINEAR_KERNEL", raising=False)  # the environment overrides the config
    monkeypatch.delenv("S2D_KERNEL_TIMES", raising=False)
    app = AppConfig.model_validate({"targets": [{"name": "t", "source": "smollm2-135m-instruct"}],
                                    "linear_kernel": "stock", "kernel_times": "off"})
    ecfg = app.engine_config("t")
    assert (ecfg.linear_kernel, ecfg.kernel_times) == ("stock", "off")
    kernels = make_kernels(ecfg)
    assert kernels.linear == "stock" and kernels.times is None
    assert AppConfig.model_validate({"targets": [{"name": "t"}]}).engine_config("t").linear_kernel == "auto"
    with pytest.raises(ValidationError, match="linear_kernel"):
        AppConfig.model_validate({"targets": [{"name": "t"}], "linear_kernel": "fastest"})
