"""Served prefix cache: requests sharing a system prompt hit the target's cache (in /metrics and /stats) and their
outputs equal target-only greedy decoding with no cache at all."""

from __future__ import annotations

import re

import httpx
import pytest

from serve_helpers import AUTH, HTTP_TIMEOUT, post
from s2d_ray.build import build_engine
from s2d_ray.config import DraftConfig, EngineConfig, PrefixCacheConfig, SpecConfig, TargetConfig
from s2d_ray.core.engine import GenerationRequest
from s2d_ray.prompts import encode_prompt

SYSTEM = " ".join(f"rule {i}: answer with {i * 3 % 11} words;" for i in range(10))


@pytest.fixture(scope="module")
def uncached(tiny_family):
    """Target-only greedy decoding in this process with the prefix cache off."""
    cfg = EngineConfig(target=TargetConfig(name="ref", source=str(tiny_family["a"]), dtype="float64"),
                       draft=DraftConfig(source="unused"), spec=SpecConfig(mode="ar"), num_threads=1,
                       prefix_cache=PrefixCacheConfig(enabled=False))
    return build_engine(cfg)


def metric(app, series: str) -> float:
    text = httpx.get(f"{app.url}/metrics", headers=AUTH, timeout=HTTP_TIMEOUT).text
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def target_stats(app) -> dict:
    return httpx.get(f"{app.url}/stats", headers=AUTH, timeout=HTTP_TIMEOUT).json()["targets"]["tiny-a"]["deployment"]


def test_shared_system_prompt_hits_the_cache_and_equals_no_cache(tiny_app, uncached):
    tok = uncached.target.tokenizer
    system_len = len(encode_prompt(tok, SYSTEM, chat=False))
    assert system_len > 40
    hits = 'vllm:prefix_cache_hits_total{model="tiny-a"}'
    queries = 'vllm:prefix_cache_queries_total{model="tiny-a"}'
    before_hits, before_queries = metric(tiny_app, hits), metric(tiny_app, queries)
    before_health = target_stats(tiny_app)["prefix_cache_hits"]
    for i, question in enumerate(["what is one?", "what is two?", "what is one?"]):
        prompt = f"{SYSTEM} question: {question}"
        r = post(f"{tiny_app.url}/v1/completions", {"model": "tiny-a", "prompt": prompt, "max_tokens": 12,
                                                     "temperature": 0})
        assert r.status_code == 200, r.text
        ids = encode_prompt(tok, prompt, chat=False)
        want = uncached.engine.generate([GenerationRequest(f"u{i}", ids, 12, stop_token_ids=(tok.eos_token_id,))])
        assert r.json()["choices"][0]["text"] == tok.decode(want[0].token_ids, skip_special_tokens=True)
    # the second and third requests found at least the system prompt (the third: its whole prompt but one token)
    assert metric(tiny_app, hits) - before_hits >= 2 * (system_len - 1)
    assert metric(tiny_app, queries) - before_queries >= metric(tiny_app, hits) - before_hits
    stats = target_stats(tiny_app)
    assert stats["prefix_cache_hits"] - before_health >= 2 * (system_len - 1)
    assert stats["prefix_cache_tokens"] <= stats["prefix_cache_max_tokens"]
