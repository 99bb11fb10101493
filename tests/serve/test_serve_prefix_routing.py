"""Prefix routing served (real Ray Serve, 127.0.0.1, tiny float64 models): 2 routers, 2 draft and 2 target replicas.
Requests sharing a system prompt (its first question sent alone), sent two at a time so the proxy spreads them over
both routers, find it cached on the replica each router sends them to: the target replicas' hits (summed by /stats
over every replica) reach 80% of what ONE in-process engine gets for the same prompts, and every output equals
target-only greedy without a cache.
Without prefix routing the two routers' home replicas each compute every system prompt (tests/unit/
test_prefix_routing.py, the negative control). Also: a tensor-parallel target's counters reach /stats."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from reliability_helpers import delete_app, deploy_app, serve_conftest
from serve_helpers import API_KEY, AUTH, HTTP_TIMEOUT, post
from s2d_ray.build import build_engine
from s2d_ray.config import DraftConfig, EngineConfig, PrefixCacheConfig, SpecConfig, TargetConfig
from s2d_ray.core.engine import GenerationRequest
from s2d_ray.prompts import encode_prompt

pytestmark = pytest.mark.serve

APP = "prefix-routing"
SYSTEMS = [" ".join(f"rule {i}: answer with {(i * s) % 11} words;" for i in range(8)) for s in (3, 5, 7)]
QUESTIONS = ["what is one?", "what is two?", "name a colour", "count to three"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def routed_app(serve_instance, tiny_family):
    from s2d_ray.serve import build_app

    two = {"num_replicas": 2, "num_cpus": 0.1}  # the session app's settings, one target, every deployment twice
    cfg = serve_conftest().tiny_config(
        tiny_family, targets=[{"name": "tiny-a", "source": str(tiny_family["a"]), "dtype": "float64", **two}],
        draft={"source": str(tiny_family["draft"]), "dtype": "float64", **two}, router=two,
        limits={"max_tokens_limit": 64, "max_concurrent_sequences": 8, "max_queued_requests": 64})
    app = deploy_app(build_app(cfg), APP, serve_instance, cfg)
    yield app
    delete_app(APP)


def engine(tiny_family, cached: bool):
    cfg = EngineConfig(target=TargetConfig(name="ref", source=str(tiny_family["a"]), dtype="float64"),
                       draft=DraftConfig(source="unused"), spec=SpecConfig(mode="ar"), num_threads=1,
                       prefix_cache=PrefixCacheConfig(enabled=cached))
    return build_engine(cfg)


def target_health(app, model: str = "tiny-a") -> dict:
    return httpx.get(f"{app.url}/stats", headers=AUTH, timeout=HTTP_TIMEOUT).json()["targets"][model]


def test_two_routers_two_targets_find_shared_prefixes_cached(routed_app, tiny_family):
    one, plain = engine(tiny_family, True), engine(tiny_family, False)
    tok = one.target.tokenizer
    prompts = [f"{system} question: {q}" for system in SYSTEMS for q in QUESTIONS]
    assert len(encode_prompt(tok, SYSTEMS[0], chat=False)) > 40  # a whole block and more

    def ask(prompt: str) -> str:
        r = post(f"{routed_app.url}/v1/completions", {"model": "tiny-a", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                      "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    # Each system prompt's first question alone, so one replica holds it; then the others two at a time: the proxy
    # gives the second to the idle router, and both must find it cached. (Two first questions sent together would
    # share their system prompt only if they met in one batch on one replica: timing, not routing.)
    firsts, rest = prompts[:: len(QUESTIONS)], [p for i, p in enumerate(prompts) if i % len(QUESTIONS)]
    prompts = firsts + rest
    with ThreadPoolExecutor(2) as pool:
        texts = [ask(p) for p in firsts]
        texts += [text for i in range(0, len(rest), 2) for text in pool.map(ask, rest[i:i + 2])]

    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        ids = encode_prompt(tok, prompt, chat=False)
        req = GenerationRequest(f"p{i}", ids, MAX_TOKENS, stop_token_ids=(tok.eos_token_id,))
        want = plain.engine.generate([req])[0].token_ids
        assert text == tok.decode(want, skip_special_tokens=True), i
        one.engine.generate([GenerationRequest(f"o{i}", ids, MAX_TOKENS, stop_token_ids=(tok.eos_token_id,))])
    reference = one.engine.verifier.prefix_cache_stats()["prefix_cache_hits"]
    totals = target_health(routed_app)["prefix_cache"]
    assert totals["replicas"] == 2, totals
    assert reference > 0 and totals["prefix_cache_hits"] >= 0.8 * reference, (totals, reference)
    health = httpx.get(f"{routed_app.url}/stats", headers=AUTH, timeout=HTTP_TIMEOUT).json()
    assert sum(health["recomputed_tokens"].get("target-tiny-a", {}).values()) == 0, health["recomputed_tokens"]


def test_tensor_parallel_target_reports_its_prefix_cache(tiny_app, tiny_family):
    system = SYSTEMS[0]
    before = target_health(tiny_app, "tiny-tp")["deployment"].get("prefix_cache_hits", 0)
    for q in QUESTIONS[:2]:
        r = post(f"{tiny_app.url}/v1/completions", {"model": "tiny-tp", "prompt": f"{system} question: {q}",
                                                    "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
    tok = engine(tiny_family, False).target.tokenizer
    stats = target_health(tiny_app, "tiny-tp")
    system_len = len(encode_prompt(tok, system, chat=False))
    assert stats["deployment"]["prefix_cache_hits"] - before >= system_len - 1, stats["deployment"]
    assert stats["prefix_cache"]["prefix_cache_hits"] == stats["deployment"]["prefix_cache_hits"]


def test_a_cached_prefix_never_crosses_models(tiny_app):
    """tiny-a and tiny-b (its weights plus noise, as an adapter would change them) share the draft but not their
    target caches: a system prompt tiny-a has cached is a miss on tiny-b, then a hit there."""
    system = " ".join(f"rule {i}: answer with {i} words;" for i in range(3))  # tiny-b's context is 128

    def hits(model: str) -> int:
        return target_health(tiny_app, model)["prefix_cache"]["prefix_cache_hits"]

    def ask(model: str, q: str) -> None:
        r = post(f"{tiny_app.url}/v1/completions", {"model": model, "prompt": f"{system} question: {q}",
                                                    "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text

    for q in QUESTIONS[:2]:
        ask("tiny-a", q)
    before = hits("tiny-b")
    ask("tiny-b", QUESTIONS[2])
    assert hits("tiny-b") == before  # nothing of tiny-a's KV was taken
    ask("tiny-b", QUESTIONS[3])
    assert hits("tiny-b") > before  # its own entry is (the check above could see hits)
