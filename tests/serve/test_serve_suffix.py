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


def test_a_repeat_at_one_request_takes_most_of_its_tokens_from_the_store(suffix_app):
    """Served at one request, a completed answer asked again is verified from the store in a few rounds (its first
    round, the prompt's, included); the same request under another scope (which holds nothing) takes as many rounds
    as the first answer. Penalised, the tiny model's output is varied text its prompt does not predict."""
    prompt = "a repeat of a finished answer should cost a few rounds, not one per token"

    def answer(user: str) -> tuple[str, int]:
        before = httpx.get(f"{suffix_app.url}/stats", headers=AUTH, timeout=HTTP_TIMEOUT).json()
        r = post(f"{suffix_app.url}/v1/completions", {"model": "tiny-a", "prompt": prompt, "max_tokens": 48,
                                                      "temperature": 0, "frequency_penalty": 1.0,
                                                      "presence_penalty": 1.0, "user": user})
        assert r.status_code == 200, r.text
        after = httpx.get(f"{suffix_app.url}/stats", headers=AUTH, timeout=HTTP_TIMEOUT).json()
        rounds = [s["targets"]["tiny-a"]["timing"]["round"]["rounds"] for s in (before, after)]
        return r.json()["choices"][0]["text"], rounds[1] - rounds[0]

    first, first_rounds = answer("carol")
    again, again_rounds = answer("carol")
    other, other_rounds = answer("dave")
    assert first == again == other  # the store changes speed only
    assert first_rounds >= 16, first_rounds  # the first answer is not predicted by its own prompt
    assert again_rounds * 4 <= first_rounds, (first_rounds, again_rounds)
    assert other_rounds >= 4 * again_rounds, (other_rounds, again_rounds)  # another scope: nothing to draft from
