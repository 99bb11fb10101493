"""Limits and access on real Ray Serve: the request timeout (504, KV freed), idle-TTL cleanup of state a dead router
left behind, an API key from the environment (401 without it, never written to any log), trust_remote_code refused
unless configured, and `model` restricted to the configured target names (never a path or another source).

The `limits` app (router + draft + one tiny target) is deployed next to the session's apps and deleted after; so is
the `envkey` app (router + one target, no draft) whose key comes from the router's environment."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest

from reliability_helpers import (
    delete_app, deploy_app, files_containing, in_replica, logs_dir, metric, stream_events,
)
from serve_helpers import API_KEY, HTTP_TIMEOUT, post, replica_actor, wait_until

pytestmark = pytest.mark.serve

APP = "limits"
CONFIG_KEY = "s2d-config-key-9c41d2aa"  # the limits app's api_key (config)
ENV_KEY = "s2d-env-key-5bd1c07e"  # the envkey app's key: only in its router's environment
KEY = {"authorization": f"Bearer {CONFIG_KEY}"}
TIMEOUT_S = 2.0
TTL_S = 3.0
ROUND_WAIT_S = 0.25
LONG = {"model": "tiny-a", "prompt": "Speculative decoding drafts tokens", "max_tokens": 64, "temperature": 0}


@pytest.fixture(scope="module")
def limits_app(serve_instance, tiny_family):
    from s2d_ray.serve import build_app

    cfg = {
        # Every verification waits ROUND_WAIT_S for a batch that never fills, and k=3 gives at most 4 tokens per
        # round: 64 tokens need >= 16 rounds (>= 4 s), far past request_timeout_s; 1 token needs one round.
        "targets": [{"name": "tiny-a", "source": str(tiny_family["a"]), "dtype": "float64", "num_cpus": 0.25,
                     "max_batch_size": 16, "batch_wait_timeout_s": ROUND_WAIT_S, "health_check_period_s": 1.0}],
        "draft": {"source": str(tiny_family["draft"]), "dtype": "float64", "num_cpus": 0.25,
                  "health_check_period_s": 1.0},
        "spec": {"mode": "s2d", "policy": "fixed", "k": 3},
        "limits": {"request_timeout_s": TIMEOUT_S, "seq_idle_ttl_s": TTL_S, "max_tokens_limit": 64},
        "api_key": CONFIG_KEY,
        "router": {"num_cpus": 0.25},
        "num_threads": 1,
    }
    app = deploy_app(build_app(cfg), APP, serve_instance, cfg)
    yield app
    delete_app(APP)


@pytest.fixture(scope="module")
def envkey_app(serve_instance, tiny_family):
    """No api_key in the config: the router reads S2D_API_KEY from its environment (here a runtime_env)."""
    from s2d_ray.serve import build_app

    cfg = {
        "targets": [{"name": "tiny-a", "source": str(tiny_family["a"]), "dtype": "float64", "num_cpus": 0.25}],
        "spec": {"mode": "ar"},
        "router": {"num_cpus": 0.25, "ray_actor_options": {"runtime_env": {"env_vars": {"S2D_API_KEY": ENV_KEY}}}},
        "num_threads": 1,
    }
    app = deploy_app(build_app(cfg), "envkey", serve_instance, cfg)
    yield app
    delete_app("envkey")


def _freed(app) -> bool:
    s = app.handle.stats.remote().result()
    t = s["targets"]["tiny-a"]
    return t["running"] == 0 and t["waiting"] == 0 and t["deployment"]["num_active"] == 0 \
        and s["draft"]["num_active"] == 0


def test_request_timeout_gives_504_and_frees_kv(limits_app):
    url = f"{limits_app.url}/v1/completions"
    series = 's2d:request_aborts_total{model="tiny-a",reason="timeout"}'
    aborts = metric(limits_app.url, series, KEY)
    short = post(url, {**LONG, "max_tokens": 1}, headers=KEY)
    assert short.status_code == 200, short.text  # the app serves; only long requests run out of time
    started = time.monotonic()
    resp = post(url, LONG, headers=KEY)
    elapsed = time.monotonic() - started
    assert resp.status_code == 504, resp.text
    err = resp.json()["error"]
    assert err["code"] == "timeout" and err["type"] == "timeout_error"
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 15
    status, events = stream_events(url, LONG, KEY)
    if status == 200:  # the first round made it in time: the error arrives in-band, then [DONE]
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "timeout", events[-3:]
        assert all("choices" in e for e in events[:-2])
    else:
        assert status == 504, events
    wait_until(lambda: _freed(limits_app), timeout_s=30)
    assert metric(limits_app.url, series, KEY) == aborts + 2


def test_idle_ttl_drops_state_a_dead_router_left(limits_app):
    """Draft and target state created through their handles and never released (as by a router that died) is
    dropped by the health check once idle for seq_idle_ttl_s, not before."""
    from ray import serve

    from s2d_ray.core.types import DraftRequest, ScoreRequest

    assert _freed(limits_app)
    draft = serve.get_deployment_handle("draft", APP)
    target = serve.get_deployment_handle("target-tiny-a", APP)
    tokens = list(range(5, 25))
    [proposal] = draft.propose.remote("tiny-a", [DraftRequest("orphan-draft", tokens, 3)], [0],
                                      affinity=None).result().results
    [logits] = target.score.remote([ScoreRequest("orphan-target", tokens, 1)], [0], affinity=None).result().results
    touched = time.monotonic()
    assert len(proposal.tokens) <= 3 and logits.shape[0] == 1
    stats = limits_app.handle.stats.remote().result()
    assert stats["draft"]["num_active"] == 1
    assert stats["targets"]["tiny-a"]["deployment"]["num_active"] == 1
    wait_until(lambda: _freed(limits_app), timeout_s=30, interval_s=0.25)
    assert time.monotonic() - touched >= TTL_S * 0.8


def _check_key(app, key: str) -> None:
    """401 (OpenAI's authentication_error) for every wrong or missing key, 200 with the right one."""
    url = f"{app.url}/v1/completions"
    ok = {**LONG, "max_tokens": 1}
    wrong = ["", "Bearer", f"Bearer {key}x", f"Bearer {key[:-1]}", f"Bearer {API_KEY}", f"Basic {key}", key,
             f"Token {key}"]
    for header in wrong:
        resp = post(url, ok, headers={"authorization": header})
        assert resp.status_code == 401, (header, resp.text)
        assert resp.json()["error"]["type"] == "authentication_error"
        assert key not in resp.text
    assert httpx.get(f"{app.url}/v1/models", timeout=HTTP_TIMEOUT).status_code == 401
    for header in (f"Bearer {key}", f"bearer {key}"):
        assert post(url, ok, headers={"authorization": header}).status_code == 200
    models = httpx.get(f"{app.url}/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=HTTP_TIMEOUT)
    assert [m["id"] for m in models.json()["data"]] == ["tiny-a"]
    assert httpx.get(f"{app.url}/health", timeout=HTTP_TIMEOUT).status_code == 200  # no key needed


def test_api_key_from_config(limits_app):
    _check_key(limits_app, CONFIG_KEY)


def test_api_key_from_environment(envkey_app):
    """The key from S2D_API_KEY works the same; s2d never logs it, but Ray's runtime_env agent logs every
    runtime_env it creates, env_vars included (hence RELIABILITY.md: set it in the node's environment instead)."""
    _check_key(envkey_app, ENV_KEY)
    found = files_containing(logs_dir(), [ENV_KEY])[ENV_KEY]
    assert {p.rsplit("/", 1)[-1] for p in found} <= {"runtime_env_agent.log"}, found


def _debug_router_logs(marker: str) -> None:
    """Make every s2d_ray logger of the router replica write DEBUG lines to its stderr (a file in the logs dir)."""

    def enable() -> None:
        import logging
        import sys

        log = logging.getLogger("s2d_ray")
        log.setLevel(logging.DEBUG)
        handler = logging.StreamHandler(sys.stderr)
        handler.setLevel(logging.DEBUG)
        log.addHandler(handler)
        logging.getLogger("s2d_ray.serve.router").debug(marker)
        handler.flush()

    in_replica(APP, "router", enable)


def test_api_key_is_never_logged(limits_app):
    """With the router's loggers at DEBUG, authorized, rejected, failing and timed-out requests leave neither the
    key (nor near-miss keys containing it) in any file of this Ray session's logs, Serve's access logs included."""
    marker = "s2d-log-probe-3f9e"
    _debug_router_logs(marker)
    url = f"{limits_app.url}/v1/completions"
    post(url, {**LONG, "max_tokens": 1}, headers=KEY)
    stream_events(url, {**LONG, "max_tokens": 2}, KEY)
    for header in (f"Bearer {CONFIG_KEY}0", f"Basic {CONFIG_KEY}", CONFIG_KEY):
        assert post(url, LONG, headers={"authorization": header}).status_code == 401
    assert post(url, b'{"model": ', headers=KEY).status_code == 400
    assert post(url, {**LONG, "model": "nope"}, headers=KEY).status_code == 404
    assert post(url, LONG, headers=KEY).status_code == 504
    root = logs_dir()
    wait_until(lambda: files_containing(root, [marker])[marker], timeout_s=20)  # we read where the router logs
    found = files_containing(root, [CONFIG_KEY, API_KEY])  # API_KEY: the session's tiny app, if deployed
    assert found == {CONFIG_KEY: [], API_KEY: []}, found


def test_secret_config_key_is_masked():
    """The config's api_key is a SecretStr: reprs, dumps and validation errors never show it."""
    from pydantic import ValidationError

    from s2d_ray.serve import AppConfig

    cfg = AppConfig(api_key=CONFIG_KEY)
    assert cfg.api_key.get_secret_value() == CONFIG_KEY
    for text in (repr(cfg), str(cfg), str(cfg.model_dump()), cfg.model_dump_json()):
        assert CONFIG_KEY not in text
    with pytest.raises(ValidationError) as info:
        AppConfig(api_key=CONFIG_KEY, nonsense=1)
    assert CONFIG_KEY not in str(info.value)


def test_only_configured_models_are_served(limits_app, tiny_family):
    """`model` is looked up among the configured target names only: paths (even the served model's own), named
    sources that are not targets, cut drafts and near-misses get 404, and nothing new is started or loaded."""
    import ray

    from s2d_ray.errors import ModelNotFoundError
    from s2d_ray.serve.openai_protocol import GenerateRequest

    actors = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True))
    names = ["gpt-4", str(tiny_family["a"]), str(tiny_family["b"]), f"{tiny_family['a']}/../tiny-a", "/etc/passwd",
             "smollm2-135m-instruct", f"cut:{tiny_family['a']}:2", "TINY-A", " tiny-a", "tiny-a/", "", "file:///etc"]
    for name in names:
        for path, body in (("completions", {**LONG, "model": name, "max_tokens": 1}),
                           ("chat/completions", {"model": name, "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 1})):
            resp = post(f"{limits_app.url}/v1/{path}", body, headers=KEY)
            assert resp.status_code == 404, (name, resp.text)
            assert resp.json()["error"]["code"] == "model_not_found"
    with pytest.raises(ModelNotFoundError):
        limits_app.handle.generate.remote(GenerateRequest(model=str(tiny_family["a"]), prompt="x")).result()
    assert sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)) == actors
    assert replica_actor(APP, "router") is not None


def _remote_code_model(src, dst, marker) -> None:
    """A copy of a tiny model whose config and tokenizer config point at code that would write `marker` if run."""
    shutil.copytree(src, dst)
    code = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    for module in ("modeling_evil.py", "configuration_evil.py", "tokenization_evil.py"):
        (dst / module).write_text(code)
    for name, auto_map in (("config.json", {"AutoConfig": "configuration_evil.EvilConfig",
                                            "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}),
                           ("tokenizer_config.json", {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]})):
        data = json.loads((dst / name).read_text())
        (dst / name).write_text(json.dumps({**data, "auto_map": auto_map}))


def test_trust_remote_code_refused_unless_configured(serve_instance, tiny_family, tmp_path):
    """A target whose checkpoint ships code (auto_map) fails to deploy with a message naming the cause, and the
    code never runs, unless the app sets trust_remote_code."""
    from s2d_ray.serve import build_app

    marker = tmp_path / "remote-code-ran"
    model = tmp_path / "evil-model"
    _remote_code_model(tiny_family["a"], model, marker)
    cfg = {"targets": [{"name": "evil", "source": str(model), "dtype": "float64", "num_cpus": 0.25}],
           "spec": {"mode": "ar"}, "router": {"num_cpus": 0.25}, "num_threads": 1}
    try:
        with pytest.raises(RuntimeError, match="auto_map") as info:
            deploy_app(build_app(cfg), "remote", serve_instance, cfg)
        assert "trust_remote_code" in str(info.value)
    finally:
        delete_app("remote")
    assert not marker.exists()
