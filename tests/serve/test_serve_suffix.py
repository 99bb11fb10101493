"""Served store of earlier outputs: scoped per bearer key and `user`, one store per target, outputs exact."""

from __future__ import annotations

import httpx
import pytest

from serve_helpers import AUTH, HTTP_TIMEOUT, Reference, post

APP = "suffix"
PROMPT = "the store keeps what the model said before, and proposes it again"


@pytest.fixture(scope="module")
def suffix_app(serve_instance, tiny_family):
    from conftest import deploy, tiny_config, undeploy
    from s2d_ray.serve import build_app

    cfg = tiny_config(tiny_family)
    cfg["targets"] = cfg["targets"][:2]  # tiny-a and tiny-b, no TP copy
    cfg["spec"] = {"mode": "lookup"}  # candidates only: no draft deployment to start
    cfg["suffix"] = {"enabled": True, "max_tokens": 4096, "scope": "api_key"}
    yield deploy(build_app(cfg), APP, serve_instance, cfg)
    undeploy(APP)


def store_stats(app, target: str) -> dict:
    return httpx.get(f"{app.url}/stats", headers=AUTH, timeout=HTTP_TIMEOUT).json()["targets"][target]["suffix"]


def complete(app, target: str, user: str) -> str:
    r = post(f"{app.url}/v1/completions", {"model": target, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                           "user": user})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_user_drafts_from_its_own_outputs_only_and_per_target(suffix_app, tiny_family):
    ref = Reference(str(tiny_family["a"]), "float64")
    want = ref.text(ref.greedy(ref.ids(PROMPT), 24))

    def matched(target: str) -> int:
        return store_stats(suffix_app, target)["suffix_matches"]

    assert complete(suffix_app, "tiny-a", "alice") == want
    held = store_stats(suffix_app, "tiny-a")
    assert held["suffix_sequences"] == 1 and held["suffix_tokens"] <= held["suffix_max_tokens"]
    before = matched("tiny-a")
    assert complete(suffix_app, "tiny-a", "bob") == want
    assert matched("tiny-a") == before  # bob's scope holds nothing of alice's
    assert complete(suffix_app, "tiny-a", "alice") == want
    assert matched("tiny-a") > before  # alice's own earlier output was proposed
    complete(suffix_app, "tiny-b", "alice")
    assert matched("tiny-b") == 0  # another target never sees tiny-a's store
