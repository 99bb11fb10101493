"""End to end on real Ray Serve (127.0.0.1) with tiny float64 models: served greedy S2D equals in-process
target-only greedy, over HTTP (streaming and not), through the Python handle, for two targets sharing one draft."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from serve_helpers import Reference, post, sse_events

pytestmark = pytest.mark.serve

PROMPTS = ["What is the capital of France?", "def add(a, b):", "The quick brown fox", "Translate to German: good"]


@pytest.fixture(scope="module")
def refs(tiny_family) -> dict[str, Reference]:
    return {name: Reference(str(tiny_family[key]), "float64") for name, key in (("tiny-a", "a"), ("tiny-b", "b"))}


def complete(app, model: str, prompt: str, max_tokens: int, **extra) -> dict:
    r = post(f"{app.url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_http_equals_in_process_target_only(tiny_app, refs):
    ref = refs["tiny-a"]
    drafted = accepted = 0
    for prompt in PROMPTS[:2]:
        body = complete(tiny_app, "tiny-a", prompt, 24)
        expected = ref.greedy(ref.ids(prompt), 24)
        choice = body["choices"][0]
        assert choice["text"] == ref.text(expected)
        assert body["usage"]["completion_tokens"] == len(expected)
        assert body["usage"]["prompt_tokens"] == len(ref.ids(prompt))
        assert choice["finish_reason"] == ("stop" if len(expected) < 24 else "length")
        m = body["metrics"]["speculative_decoding"]
        drafted += m["num_draft_tokens"]
        accepted += m["num_accepted_draft_tokens"]
    assert 0 < accepted < drafted  # the draft was really used, and both accept and reject paths ran


def test_speculate_false_opts_one_request_out(tiny_app, refs):
    """The per-request opt-out: no draft tokens for that request, the same text; the handle API takes it too."""
    from s2d_ray.serve.openai_protocol import GenerateRequest

    ref = refs["tiny-a"]
    expected = ref.text(ref.greedy(ref.ids(PROMPTS[0]), 24))
    plain = complete(tiny_app, "tiny-a", PROMPTS[0], 24, speculate=False)
    spec = complete(tiny_app, "tiny-a", PROMPTS[0], 24)
    assert plain["choices"][0]["text"] == spec["choices"][0]["text"] == expected
    assert plain["metrics"]["speculative_decoding"]["num_draft_tokens"] == 0
    assert spec["metrics"]["speculative_decoding"]["num_draft_tokens"] > 0
    resp = tiny_app.handle.generate.remote(GenerateRequest(model="tiny-a", prompt=PROMPTS[0], max_tokens=24,
                                                           speculate=False)).result()
    assert resp.text == expected and resp.metrics["num_draft_tokens"] == 0


def test_plain_requests_take_several_target_steps_per_call(tiny_app, refs):
    """`plain_steps` (default 4): rounds where no row speculates ask the target deployment for several greedy tokens
    per call (the round that fills the prompt is one pass); the text is still target greedy (streamed or not,
    max_tokens exact) and the calls about a quarter."""
    ref = refs["tiny-a"]

    def calls() -> int:
        return tiny_app.handle.stats.remote().result()["targets"]["tiny-a"]["deployment"]["num_calls"]

    expected = ref.greedy(ref.ids(PROMPTS[2]), 24)
    before = calls()
    body = complete(tiny_app, "tiny-a", PROMPTS[2], 24, speculate=False)
    used = calls() - before
    assert body["choices"][0]["text"] == ref.text(expected) and body["usage"]["completion_tokens"] == len(expected)
    assert used <= 1 + -(-(len(expected) - 1) // 4)  # the prompt's pass, then 4 a call; one step each: len(expected)
    short = complete(tiny_app, "tiny-a", PROMPTS[2], 7, speculate=False)
    assert short["usage"]["completion_tokens"] == min(7, len(expected))
    assert short["choices"][0]["text"] == ref.text(expected[:7])
    events = sse_events(f"{tiny_app.url}/v1/completions", {"model": "tiny-a", "prompt": PROMPTS[2], "max_tokens": 24,
                                                           "temperature": 0, "speculate": False})
    assert "".join(c["choices"][0]["text"] for c in events[:-1] if c["choices"]) == ref.text(expected)


def test_stream_concatenates_to_non_streaming(tiny_app):
    body = {"model": "tiny-a", "prompt": PROMPTS[2], "max_tokens": 30, "temperature": 0}
    r = post(f"{tiny_app.url}/v1/completions", body)
    assert r.status_code == 200
    full = r.json()
    events = sse_events(f"{tiny_app.url}/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert chunks[-1]["usage"] == full["usage"]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)


def test_chat_stream_and_not(tiny_app, refs):
    ref = refs["tiny-b"]
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    body = {"model": "tiny-b", "messages": messages, "max_tokens": 20, "temperature": 0}
    r = post(f"{tiny_app.url}/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion"
    expected = ref.greedy(ref.ids(messages=messages), 20)
    assert out["choices"][0]["message"] == {"role": "assistant", "content": ref.text(expected)}
    events = sse_events(f"{tiny_app.url}/v1/chat/completions", body)
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == ref.text(expected)


def test_two_targets_concurrently_through_one_draft(tiny_app, refs):
    """Requests for both targets at once: each equals its own target's greedy; the one draft replica merged them."""
    before = tiny_app.handle.stats.remote().result()["draft"]
    jobs = [(m, p) for p in PROMPTS for m in ("tiny-a", "tiny-b")]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda job: complete(tiny_app, job[0], job[1], 24), jobs))
    for (model, prompt), body in zip(jobs, outs):
        ref = refs[model]
        assert body["choices"][0]["text"] == ref.text(ref.greedy(ref.ids(prompt), 24)), (model, prompt)
    after = tiny_app.handle.stats.remote().result()["draft"]
    calls, forwards = after["num_calls"] - before["num_calls"], after["num_forwards"] - before["num_forwards"]
    assert forwards < calls  # propose calls were merged into shared forwards ...
    assert after["num_merged_forwards"] > before["num_merged_forwards"]  # ... with both targets in one forward


def test_three_targets_under_load_share_draft_forwards(tiny_app, refs, tiny_family):
    """3 targets x 4 concurrent sequences: most drafting is done in forwards that carry rows of more than one target
    (the adaptive window waits for the other targets' rounds), and every output equals its target's greedy.

    Counted in rows, not forwards: the tail, when one target's sequences are done and another's still run, adds
    single-target forwards of few rows whose number depends on the machine's timing (on a slow runner they can
    outnumber the merged ones); the share of rows drafted together is what saves draft compute."""
    tp_ref = Reference(str(tiny_family["a"]), "float32")  # tiny-tp serves model a in float32
    before = tiny_app.handle.stats.remote().result()["draft"]
    jobs = [(m, p) for p in PROMPTS for m in ("tiny-a", "tiny-b", "tiny-tp")]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda job: complete(tiny_app, job[0], job[1], 32), jobs))
    for (model, prompt), body in zip(jobs, outs):
        ref = tp_ref if model == "tiny-tp" else refs[model]
        assert body["choices"][0]["text"] == ref.text(ref.greedy(ref.ids(prompt), 32)), (model, prompt)
    after = tiny_app.handle.stats.remote().result()["draft"]
    rows = after["num_rows"] - before["num_rows"]
    merged = after["num_merged_rows"] - before["num_merged_rows"]
    assert rows > 0 and merged / rows >= 0.5, (merged, rows, after)
    assert after["num_merged_forwards"] > before["num_merged_forwards"]
    assert after["rows_per_forward"] > 1 and after["busy_s"] > before["busy_s"]


def test_stats_show_each_processs_kernels_and_the_drafts_cpu_time(tiny_app):
    """The kernels each replica measured and chose when it loaded (they can differ between replicas of one model:
    replicas load side by side), and per call the draft forward's CPU time beside its wall time (what tells a draft
    waiting for a core or the GIL from a slow one)."""
    complete(tiny_app, "tiny-a", PROMPTS[0], 8)
    stats = tiny_app.handle.stats.remote().result()
    for kernels in (stats["targets"]["tiny-a"]["deployment"]["kernels"], stats["draft"]["kernels"]):
        chosen = kernels["attention"].split(",")
        assert [c.split(":")[0] for c in chosen] == ["decode", "tree", "prompt", "batch"]
        assert {c.split(":")[1] for c in chosen} <= {"sdpa", "grouped"}
        assert kernels["packed_several"] == kernels["packed_one_row"] == 0  # float64: never packed
    draft = stats["targets"]["tiny-a"]["timing"]["draft"]
    assert draft["calls"] > 0 and 0 < draft["mean_replica_cpu_ms"] <= draft["mean_replica_ms"] + 1.0


def test_handle_api_generate_and_stream(tiny_app, refs):
    from s2d_ray.serve.openai_protocol import GenerateRequest

    ref = refs["tiny-a"]
    req = GenerateRequest(model="tiny-a", prompt=PROMPTS[3], max_tokens=16)
    resp = tiny_app.handle.generate.remote(req).result()
    expected = ref.greedy(ref.ids(PROMPTS[3]), 16)
    assert resp.token_ids == expected
    assert resp.text == ref.text(expected)

    async def stream():
        gen = tiny_app.handle.options(stream=True).generate_stream.remote(req)
        return [chunk async for chunk in gen]

    chunks = asyncio.run(stream())
    assert [t for c in chunks for t in c.token_ids] == expected
    assert "".join(c.text for c in chunks) == resp.text
    assert chunks[-1].usage.completion_tokens == len(expected)


def test_seeded_sampling_equals_in_process_s2d(tiny_app, tiny_family):
    """At temperature > 0 the draft's q travels through Ray: served tokens equal in-process S2D with the same seed
    (every random draw is keyed on (seed, position)), and the rejection path was exercised."""
    from s2d_ray.core.types import SamplingParams

    spec = tiny_app.config["spec"]
    ref = Reference(str(tiny_family["a"]), "float64", draft=str(tiny_family["draft"]), spec=spec)
    prompt = "Natalia sold clips to 48 of her friends"
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    expected = ref.greedy(ref.ids(prompt), 32, params)
    body = complete(tiny_app, "tiny-a", prompt, 32, temperature=0.9, top_p=0.95, seed=1234)
    assert body["choices"][0]["text"] == ref.text(expected)
    m = body["metrics"]["speculative_decoding"]
    assert 0 < m["num_accepted_draft_tokens"] < m["num_draft_tokens"]


def test_draft_capacity_bench_reads_the_shared_draft(tiny_app, tmp_path):
    """`s2d bench draft-capacity`'s run: 1 then 2 targets at 1 and 2 streams each, figures from the draft's counters.
    One target alone never shares a forward; two targets under load do."""
    from s2d_ray.bench.draft_capacity import CapacityRun, capacity_markdown, plot_capacity, run_capacity
    from s2d_ray.bench.serve import LoadRun
    from serve_helpers import API_KEY

    load = LoadRun(tiny_app.url, "tiny-a", [1, 2], requests=4, max_seconds=60, max_tokens=16, timeout=60,
                   api_key=API_KEY)
    result = asyncio.run(run_capacity(CapacityRun(load, ["tiny-a", "tiny-b"]), PROMPTS))
    levels = result["levels"]
    assert [(lv["targets"], lv["per_target"], lv["concurrency"]) for lv in levels] == [
        (1, 1, 1), (1, 2, 2), (2, 1, 2), (2, 2, 4)]
    assert [(lv["sent"], lv["errors"]) for lv in levels] == [(4, 0), (4, 0), (8, 0), (8, 0)]
    for lv in levels:
        d = lv["draft"]
        assert d["calls"] >= lv["sent"] and d["forwards"] >= 1 and d["rows_per_forward"] >= 1, d
        assert 0 < d["busy_fraction"] <= 1 and 0 < d["forward_ms"] < d["round_ms"], d
        assert d["queue_delay_ms"] >= 0 and d["draft_share_of_round"] > 0, d
    assert all(lv["draft"]["merged_forward_share"] == 0 for lv in levels if lv["targets"] == 1)
    assert max(lv["draft"]["merged_row_share"] for lv in levels if lv["targets"] == 2) > 0
    assert "| 2 | 2 |" in capacity_markdown(result)
    assert plot_capacity(result, tmp_path / "capacity.png").stat().st_size > 1000


def test_bench_warms_up_each_variant_before_it_counts(tiny_app):
    """`s2d bench serve --warmup N`: N requests per variant (speculative, plain) go first, on the run's first
    prompts, and no level counts them."""
    from s2d_ray.bench.serve import LoadRun, run_load
    from serve_helpers import API_KEY

    load = LoadRun(tiny_app.url, "tiny-a", [1], requests=2, max_seconds=60, max_tokens=8, timeout=60,
                   api_key=API_KEY, compare_plain=True, warmup=2)
    result = asyncio.run(run_load(load, PROMPTS[:2]))
    assert [(w["variant"], w["ok"]) for w in result["warmup"]] == [("speculative", True)] * 2 + [("plain", True)] * 2
    assert all(w["latency"] > 0 and w["tokens"] >= 1 for w in result["warmup"])
    assert [(s["variant"], s["completed"]) for s in result["summary"]] == [("speculative", 2), ("plain", 2)]
    assert sorted(r["prompt_index"] for rows in result["requests"].values() for r in rows) == [0, 0, 1, 1]


def test_bench_pairs_served_runs_with_its_in_process_twin(tiny_app, refs):
    """`s2d bench serve --twin`: the router's engine for the target, built in the bench's process from the app's own
    config, decodes exactly what the server does (fp64 greedy = target-only greedy, alone and batched), and each
    pair runs the served level and the twin on the same requests, the order alternating."""
    from s2d_ray.bench.serve import LoadRun, run_load
    from s2d_ray.bench.serve_report import serve_markdown
    from s2d_ray.bench.twin import build_twin, run_twin_level
    from s2d_ray.errors import ConfigError
    from s2d_ray.serve.app_config import AppConfig
    from serve_helpers import API_KEY

    app = AppConfig.model_validate(tiny_app.config)
    with pytest.raises(ConfigError, match="tp_size 2"):
        build_twin(app, "tiny-tp", PROMPTS)
    with pytest.raises(ConfigError, match="no target 'nope'"):
        build_twin(app, "nope", PROMPTS)
    twin = build_twin(app, "tiny-a", PROMPTS[:3])
    ref = refs["tiny-a"]
    expected = [ref.greedy(ref.ids(p), 8) for p in PROMPTS[:3]]
    batched = run_twin_level(twin, 2, 3, 8)  # two rows at once, the third joins when one ends
    assert batched["token_ids"] == expected and batched["output_tokens"] == sum(map(len, expected))
    assert run_twin_level(twin, 1, 3, 8, speculate=False)["token_ids"] == expected

    load = LoadRun(tiny_app.url, "tiny-a", [1], requests=3, max_seconds=60, max_tokens=8, timeout=60,
                   api_key=API_KEY, compare_plain=True, warmup=1, twin_pairs=2)
    result = asyncio.run(run_load(load, PROMPTS[:3], twin))
    pairs = result["twin"]["pairs"]
    assert [(x["pair"], x["variant"], x["first"]) for x in pairs] == [
        (0, "speculative", "served"), (0, "plain", "served"), (1, "speculative", "twin"), (1, "plain", "twin")]
    for x in pairs:
        assert x["served"]["completed"] == x["twin"]["requests"] == 3 and x["equal_tokens"], x
        assert x["ratio"] > 0 and x["twin"]["speculate"] == (x["variant"] == "speculative")
    assert pairs[0]["twin"]["num_accepted_draft_tokens"] > 0  # the speculative twin drafted (policy fixed, k 4)
    assert pairs[1]["twin"]["num_draft_tokens"] == 0  # the plain one never did
    assert set(result["twin"]["median_ratio"]) == {"speculative", "plain"}
    assert "Median served / twin: plain" in serve_markdown(result)


def test_a_stream_interval_sends_fewer_chunks_of_the_same_tokens(serve_instance, tiny_family, refs):
    """`router.stream_interval: 5`: streamed over HTTP and through the handle, every chunk between the first and the
    last holds at least 5 tokens (the first goes at once), and the tokens, logprobs and text are target greedy's."""
    from conftest import deploy, tiny_config, undeploy
    from s2d_ray.serve import build_app
    from s2d_ray.serve.openai_protocol import GenerateRequest

    cfg = tiny_config(tiny_family, targets=[{"name": "tiny-a", "source": str(tiny_family["a"]), "dtype": "float64",
                                             "num_cpus": 0.25}],
                      router={"num_cpus": 0.25, "stream_interval": 5})
    app = deploy(build_app(cfg), "tinystream", serve_instance, cfg)
    try:
        ref = refs["tiny-a"]
        expected = ref.greedy(ref.ids(PROMPTS[2]), 30)
        events = sse_events(f"{app.url}/v1/completions", {"model": "tiny-a", "prompt": PROMPTS[2], "max_tokens": 30,
                                                          "temperature": 0, "logprobs": 1, "return_token_ids": True})
        chunks = [e for e in events[:-1] if e["choices"]]
        ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        assert ids == expected and "".join(c["choices"][0]["text"] for c in chunks) == ref.text(expected)
        assert all(len(c["choices"][0]["token_ids"]) >= 5 for c in chunks[1:-1]) and len(chunks) >= 3, chunks
        assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == len(expected)
        assert chunks[-1]["choices"][0]["finish_reason"] == ("stop" if len(expected) < 30 else "length")

        async def stream():
            req = GenerateRequest(model="tiny-a", prompt=PROMPTS[3], max_tokens=24)
            return [c async for c in app.handle.options(stream=True).generate_stream.remote(req)]

        got = asyncio.run(stream())
        assert [t for c in got for t in c.token_ids] == ref.greedy(ref.ids(PROMPTS[3]), 24)
        assert all(len(c.token_ids) >= 5 for c in got[1:-1])
    finally:
        undeploy("tinystream")
