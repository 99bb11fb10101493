"""Faults: the draft replica dies mid-request; decoding continues target-only (same tokens) and speculation resumes
once Serve has replaced the replica. A TP rank dies mid-request; the stream completes exactly on the new group."""

from __future__ import annotations

import json

import httpx
import pytest

from reliability_helpers import metric
from serve_helpers import AUTH, HTTP_TIMEOUT, Reference, replica_actor, wait_until

pytestmark = pytest.mark.serve


def _fallback_rounds(app) -> float:
    text = httpx.get(f"{app.url}/metrics", headers=AUTH, timeout=HTTP_TIMEOUT).text
    line = next((ln for ln in text.splitlines()
                 if ln.startswith('s2d:spec_decode_draft_fallback_rounds_total{model="tiny-a"}')), None)
    return float(line.split()[-1]) if line else 0.0


def test_draft_death_mid_request_is_lossless_and_speculation_resumes(faults_app, tiny_family):
    import ray

    ref = Reference(str(tiny_family["a"]), "float64")
    prompt_ids = ref.ids("Speculative decoding drafts tokens with a small model")
    expected = ref.greedy(prompt_ids, 64)
    assert len(expected) == 64
    body = {"model": "tiny-a", "prompt": prompt_ids, "max_tokens": 64, "temperature": 0, "stream": True}
    chunks = []
    draft = replica_actor("faults", "draft")  # looked up first: the kill must land while the request's rounds run
    with httpx.stream("POST", f"{faults_app.url}/v1/completions", content=json.dumps(body),
                      headers={"content-type": "application/json"}, timeout=HTTP_TIMEOUT) as resp:
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
                break
        ray.kill(draft, no_restart=True)  # the draft dies while the request runs
        chunks += [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ") and ln != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref.text(expected)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert _fallback_rounds(faults_app) > 0
    ready = httpx.get(f"{faults_app.url}/health/ready/tiny-a", timeout=HTTP_TIMEOUT)
    assert ready.status_code == 200  # the target still serves; a draft down never makes a model unready

    def speculating() -> bool:
        out = httpx.post(f"{faults_app.url}/v1/completions", timeout=HTTP_TIMEOUT, json={
            "model": "tiny-a", "prompt": prompt_ids, "max_tokens": 8, "temperature": 0}).json()
        assert out["choices"][0]["text"] == ref.text(expected[:8])
        return out["metrics"]["speculative_decoding"]["num_draft_tokens"] > 0

    wait_until(speculating, timeout_s=90, interval_s=1.0)


@pytest.mark.tp
def test_tp_rank_death_mid_stream_completes_exactly_on_the_reformed_group(faults_app, tiny_family):
    """Kill one rank mid-request: the group is broken, so the router resends the round (bounded by the target's
    failover_s) until Serve's replacement replica has formed a new group on a fresh port, which rebuilds the sequence
    from its prompt and committed tokens: the stream completes with exactly the target's greedy tokens."""
    import os
    import signal
    import time

    ref = Reference(str(tiny_family["a"]), "float32")
    prompt_ids = ref.ids("Speculative decoding drafts tokens with a small model")
    expected = ref.greedy(prompt_ids, 64)
    before = faults_app.handle.stats.remote().result()["targets"]["tiny-tp"]["deployment"]
    failovers = metric(faults_app.url, 's2d_target_failovers_total{model="tiny-tp"}')
    body = {"model": "tiny-tp", "prompt": prompt_ids, "max_tokens": 64, "temperature": 0, "stream": True,
            "return_token_ids": True}
    events, started = [], time.monotonic()
    with httpx.stream("POST", f"{faults_app.url}/v1/completions", content=json.dumps(body),
                      headers={"content-type": "application/json"}, timeout=HTTP_TIMEOUT) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if not events:
                os.kill(before["ranks"][1]["pid"], signal.SIGKILL)
            events.append(line[6:])
    assert time.monotonic() - started < 180  # bounded by failover_s
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["error"] for c in chunks if "error" in c] == []
    tokens = [t for c in chunks for t in c["choices"][0].get("token_ids") or []]
    assert len(chunks[0]["choices"][0].get("token_ids") or []) < 64, "the rank died after the stream had finished"
    assert tokens == expected  # not ended early, nothing repeated or skipped
    assert metric(faults_app.url, 's2d_target_failovers_total{model="tiny-tp"}') > failovers

    def reformed() -> dict | None:
        dep = faults_app.handle.stats.remote().result()["targets"]["tiny-tp"]["deployment"]
        return dep if "ranks" in dep and dep["port"] != before["port"] else None

    after = wait_until(reformed, timeout_s=120, interval_s=1.0)
    assert {r["pid"] for r in after["ranks"]}.isdisjoint({r["pid"] for r in before["ranks"]})
    out = httpx.post(f"{faults_app.url}/v1/completions", timeout=HTTP_TIMEOUT, json={
        "model": "tiny-tp", "prompt": prompt_ids, "max_tokens": 16, "temperature": 0})
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["text"] == ref.text(expected[:16])
