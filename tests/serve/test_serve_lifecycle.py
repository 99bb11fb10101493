"""Tensor parallelism, stop strings, client disconnects, metrics and the `openai` client against the tiny app."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from serve_helpers import API_KEY, AUTH, HTTP_TIMEOUT, Reference, post, wait_until

pytestmark = pytest.mark.serve

LONG_PROMPT = "Speculative decoding drafts tokens with a small model"


@pytest.fixture(scope="module")
def ref32(tiny_family) -> Reference:
    return Reference(str(tiny_family["a"]), "float32")


@pytest.fixture(scope="module")
def ref64(tiny_family) -> Reference:
    return Reference(str(tiny_family["a"]), "float64")


@pytest.mark.tp
def test_tp_target_gives_the_same_tokens_as_tp1(tiny_app, ref32):
    from s2d_ray.serve.openai_protocol import GenerateRequest
    from s2d_ray.shm_buffers import buffer_paths

    stats = tiny_app.handle.stats.remote().result()["targets"]["tiny-tp"]["deployment"]
    assert stats["tp_size"] == 2 and len(stats["ranks"]) == 2
    assert len({r["pid"] for r in stats["ranks"]}) == 2  # two processes, one torch.distributed world
    assert stats["ranks"][0]["backend"] == "gloo"
    assert all(r["loading"] == "shard" and r["peak_rss_bytes"] > 0 for r in stats["ranks"])  # models/shards.py
    assert (stats["device"], stats["dtype"]) == ("cpu", "float32")
    for prompt in ("What is the capital of France?", "def add(a, b):"):
        resp = tiny_app.handle.generate.remote(GenerateRequest(model="tiny-tp", prompt=prompt, max_tokens=24)).result()
        assert resp.token_ids == ref32.greedy(ref32.ids(prompt), 24)
        assert resp.metrics["num_draft_tokens"] > 0
    assert buffer_paths(stats["port"]) == []  # all-reduces still run on the mappings; no /dev/shm file outlives them


def test_every_replica_counts_its_collector_pauses(tiny_app):
    """The router, the draft and each target replica count their process's collections from their __init__ on
    (s2d_ray/gc_pauses.py): at least the full collection Serve runs before freezing the loaded heap, and that heap
    frozen (the objects no full collection walks while serving)."""
    stats = tiny_app.handle.stats.remote().result()
    processes = {"router": stats["gc"], "draft": stats["draft"]["gc"],
                 **{name: t["deployment"]["gc"] for name, t in stats["targets"].items()}}
    for name, gc in processes.items():
        assert set(gc) == {"gen0", "gen1", "gen2", "frozen"}, name
        assert gc["gen2"]["collections"] >= 1 and gc["gen2"]["recent_ms"], (name, gc)
        assert gc["frozen"] > 10_000, (name, gc)  # Ray, Serve, FastAPI, torch, transformers, the models


def test_stop_string_ends_and_is_not_returned(tiny_app, ref64):
    prompt = "What is the capital of France?"
    full_text = ref64.text(ref64.greedy(ref64.ids(prompt), 24))
    stop = full_text[len(full_text) // 2: len(full_text) // 2 + 3]
    assert len(stop) == 3 and stop.strip(), full_text
    body = post(f"{tiny_app.url}/v1/completions", {"model": "tiny-a", "prompt": prompt, "max_tokens": 24,
                                                   "temperature": 0, "stop": [stop]}).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == full_text[: full_text.find(stop)]


def test_disconnect_aborts_and_frees_kv_on_draft_and_target(tiny_app, ref64):
    """Read one streamed chunk of a long generation, hang up: the request is aborted and no KV is left behind. The
    generation is 400 tokens so that it is still running when the stats call lands, on any host."""
    prompt_ids = ref64.ids(LONG_PROMPT)
    assert len(ref64.greedy(prompt_ids, 400)) == 400  # it would run all 400 tokens if nobody stopped it
    aborts_before = _metric(tiny_app, 's2d:request_aborts_total{model="tiny-a",reason="cancelled"}')
    body = {"model": "tiny-a", "prompt": prompt_ids, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{tiny_app.url}/v1/completions", content=json.dumps(body),
                      headers={"content-type": "application/json", **AUTH}, timeout=HTTP_TIMEOUT) as resp:
        assert resp.status_code == 200
        first = next(line for line in resp.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
        stats = tiny_app.handle.stats.remote().result()
        assert stats["targets"]["tiny-a"]["running"] == 1, (stats, first, list(resp.iter_lines())[-3:])
        assert stats["targets"]["tiny-a"]["deployment"]["num_active"] == 1
    # Connection closed mid-generation.

    def freed():
        s = tiny_app.handle.stats.remote().result()
        t = s["targets"]["tiny-a"]
        return t["running"] == 0 and t["deployment"]["num_active"] == 0 and s["draft"]["num_active"] == 0

    wait_until(freed, timeout_s=30)
    assert _metric(tiny_app, 's2d:request_aborts_total{model="tiny-a",reason="cancelled"}') == aborts_before + 1


def _metric(app, series: str) -> float:
    text = httpx.get(f"{app.url}/metrics", headers=AUTH, timeout=HTTP_TIMEOUT).text
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_metrics_count_speculation_per_model_and_exit(tiny_app):
    before = _metric(tiny_app, 'vllm:spec_decode_num_draft_tokens_total{model="tiny-a"}')
    resp = post(f"{tiny_app.url}/v1/completions", {"model": "tiny-a", "prompt": "def add(a, b):", "max_tokens": 16,
                                                   "temperature": 0}).json()
    spec = resp["metrics"]["speculative_decoding"]
    after = _metric(tiny_app, 'vllm:spec_decode_num_draft_tokens_total{model="tiny-a"}')
    assert after - before == spec["num_draft_tokens"] > 0
    text = httpx.get(f"{tiny_app.url}/metrics", headers=AUTH, timeout=HTTP_TIMEOUT).text
    exits = {re.search(r'exit="(\d+)"', line).group(1) for line in text.splitlines()
             if line.startswith("s2d:spec_decode_num_draft_tokens_by_exit_total{") and 'model="tiny-a"' in line}
    assert exits and exits <= {"1", "2", "3"}
    for name in ("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_emitted_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_success_total"):
        assert name in text


def test_openai_python_client(tiny_app, ref64):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{tiny_app.url}/v1", api_key=API_KEY, timeout=60, max_retries=0)
    prompt = "The quick brown fox"
    expected = ref64.text(ref64.greedy(ref64.ids(prompt), 12))
    out = client.completions.create(model="tiny-a", prompt=prompt, max_tokens=12, temperature=0)
    assert out.choices[0].text == expected
    stream = client.completions.create(model="tiny-a", prompt=prompt, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected
    chat = client.chat.completions.create(model="tiny-b", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-a", prompt="x", max_tokens=0)
