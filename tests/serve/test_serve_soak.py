"""A bounded soak of the served app (tiny float64 models, two targets sharing one draft): 32 warm-up + 208 requests
(env S2D_SOAK_REQUESTS) at concurrency 16 mixing prompt lengths, max_tokens, completions and chat, streaming and not,
greedy and seeded sampling, client hang-ups mid-stream, client timeouts and bad input; a quarter of the greedy requests
also fill stop strings, bad words and logit biases with values that leave the output as it is (NO_OP_BOUNDS).

It asserts: no request is lost or hangs (each ends within a bound, the whole run within another), greedy output
equals in-process target-only greedy, seeded sampled output equals in-process S2D with the same seed, bad input gets
its 4xx, no 5xx or 429 at all; afterwards no per-sequence state is left on the router, the draft or the targets, and
every replica's memory is back near its baseline (taken after a warm-up with the same mix). Figures are printed
(`-s`) for RELIABILITY.md.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
import pytest

from reliability_helpers import delete_app, deploy_app, metric, replica_memory_mib
from serve_helpers import AUTH, API_KEY, HTTP_TIMEOUT, Reference

pytestmark = pytest.mark.serve

APP = "soak"
SPEC = {"mode": "s2d", "policy": "fixed", "k": 4}
CONCURRENCY = 16
N_WARMUP = 32
N_SOAK = int(os.environ.get("S2D_SOAK_REQUESTS", "208"))  # raise it for a longer soak
REQUEST_BOUND_S = 90.0  # any single request, queueing included
RUN_BOUND_S = 150.0 * max(1.0, N_SOAK / 208)  # the whole soak phase
MEMORY_MARGIN_MIB = 48.0
DEPLOYMENTS = ("router", "draft", "target-tiny-a", "target-tiny-b")
MAX_PROMPT = {"tiny-a": 160, "tiny-b": 72}  # tiny-b's context is 128
MAX_TOKENS = [1, 2, 5, 8, 16, 24, 32, 48]
CHAT_TEXTS = ["hi", "Write a short poem about the sea.", "What is 17 * 23?", "Name three primary colors, please."]
# Per-request bounds filled with values that leave greedy output as it is (strings the tiny models never write, zero
# biases): these requests run every penalty processor on full rows, under concurrency, and must still be exact.
NO_OP_BOUNDS = {
    "stop": [f"\u2603never-{i}-" + "q" * 24 for i in range(4)],
    "bad_words": [f"\u2603bad{i}\u2603" for i in range(24)],
    "logit_bias": {str(i): 0.0 for i in range(3, 83)},
}
BAD = [  # (body, path, status, headers)
    (b'{"model": "tiny-a", "prompt": ', "completions", 400, None),
    ({"model": "gpt-17", "prompt": "x", "max_tokens": 2}, "completions", 404, None),
    ({"model": "tiny-a", "prompt": "x", "max_tokens": 0}, "completions", 400, None),
    ({"model": "tiny-a", "prompt": "x", "max_tokens": 65}, "completions", 400, None),
    ({"model": "tiny-b", "prompt": [5] * 140, "max_tokens": 2}, "completions", 400, None),
    ({"model": "tiny-a", "prompt": "x" * 9000, "max_tokens": 2}, "completions", 413, None),
    ({"model": "tiny-a", "messages": [], "max_tokens": 2}, "chat/completions", 400, None),
    ({"model": "tiny-a", "prompt": "x", "max_tokens": 2}, "completions", 401, {"authorization": "Bearer nope"}),
    (b"[" * 3000 + b"]" * 3000, "completions", 400, None),
]


@pytest.fixture(scope="module")
def soak_app(serve_instance, tiny_family):
    from s2d_ray.serve import build_app

    target = {"dtype": "float64", "num_cpus": 0.25}
    cfg = {
        "targets": [{"name": "tiny-a", "source": str(tiny_family["a"]), **target},
                    {"name": "tiny-b", "source": str(tiny_family["b"]), "max_context": 128, **target}],
        "draft": {"source": str(tiny_family["draft"]), "dtype": "float64", "num_cpus": 0.25},
        "spec": SPEC,
        "limits": {"max_tokens_limit": 64, "max_body_bytes": 8192, "max_concurrent_sequences": 8,
                   "max_queued_requests": 32, "request_timeout_s": 120.0},
        "api_key": API_KEY,
        "router": {"num_cpus": 0.25},
        "num_threads": 1,
    }
    app = deploy_app(build_app(cfg), APP, serve_instance, cfg)
    yield app
    delete_app(APP)


@dataclass
class Job:
    kind: str  # greedy | sampled | hangup | client-timeout | bad
    path: str
    body: dict | bytes
    stream: bool = False
    status: int = 200
    headers: dict = field(default_factory=dict)
    expected_text: str | None = None
    expected_tokens: int | None = None


@dataclass
class Outcome:
    job: Job
    status: int | None
    latency_s: float
    text: str = ""
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None


def _prompt(rng: random.Random, ref: Reference, model: str, max_tokens: int, chat: bool) -> tuple[dict, list[int]]:
    """A prompt of random kind and length that fits the model with max_tokens: token ids, text, or chat messages."""
    if chat:
        messages = [{"role": "user", "content": rng.choice(CHAT_TEXTS)}]
        return {"messages": messages}, ref.ids(messages=messages)
    if rng.random() < 0.25:
        text = " ".join(rng.choice(CHAT_TEXTS) for _ in range(rng.randint(1, 3)))
        return {"prompt": text}, ref.ids(text)
    n = rng.randint(1, MAX_PROMPT[model] - max_tokens)
    ids = [rng.randrange(3, 320) for _ in range(n)]
    return {"prompt": ids}, ids


def _good_job(rng: random.Random, refs: dict, sampled: bool) -> Job:
    model = rng.choice(["tiny-a", "tiny-b"])
    max_tokens = rng.choice(MAX_TOKENS)
    chat = rng.random() < 0.2
    body, ids = _prompt(rng, refs[model]["greedy"], model, max_tokens, chat)
    body.update(model=model, max_tokens=max_tokens, temperature=0)
    params = None
    if sampled:
        from s2d_ray.core.types import SamplingParams

        params = SamplingParams(temperature=rng.choice([0.6, 0.9, 1.3]), top_k=rng.choice([0, 20]),
                                top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(1 << 31))
        body.update(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed)
    if not sampled and rng.random() < 0.25:
        body.update(NO_OP_BOUNDS)
    ref = refs[model]["sampled" if sampled else "greedy"]
    out = ref.greedy(ids, max_tokens, params) if params else ref.greedy(ids, max_tokens)
    return Job("sampled" if sampled else "greedy", "chat/completions" if chat else "completions", body,
               stream=rng.random() < 0.4, expected_text=ref.text(out), expected_tokens=len(out))


def plan(rng: random.Random, refs: dict, n: int) -> list[Job]:
    """n jobs: ~60% greedy, ~17% seeded sampling, ~10% hang-ups, ~3% client timeouts, ~10% bad input."""
    jobs = []
    for _ in range(n):
        r = rng.random()
        if r < 0.60:
            jobs.append(_good_job(rng, refs, sampled=False))
        elif r < 0.77:
            jobs.append(_good_job(rng, refs, sampled=True))
        elif r < 0.90:
            model = rng.choice(["tiny-a", "tiny-b"])
            body = {"model": model, "prompt": [rng.randrange(3, 320) for _ in range(8)], "max_tokens": 64,
                    "temperature": rng.choice([0, 0.8]), "seed": 1}
            jobs.append(Job("hangup" if r < 0.87 else "client-timeout", "completions", body, stream=r < 0.87))
        else:
            body, path, status, headers = rng.choice(BAD)
            jobs.append(Job("bad", path, body, status=status, headers=headers or {}))
    return jobs


def _read_stream(resp: httpx.Response, out: Outcome, chat: bool, hang_up: bool) -> None:
    for line in resp.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            out.error = json.dumps(event["error"])
            return
        choice = event["choices"][0]
        out.text += choice["delta"].get("content", "") if chat else choice["text"]
        out.finish_reason = choice["finish_reason"] or out.finish_reason
        if "usage" in event:
            out.completion_tokens = event["usage"]["completion_tokens"]
        if hang_up:
            return  # closing the response drops the connection mid-generation


def run_job(url: str, job: Job) -> Outcome:
    chat = job.path.startswith("chat")
    content = job.body if isinstance(job.body, bytes) else json.dumps({**job.body, "stream": job.stream})
    headers = {"content-type": "application/json", **AUTH, **job.headers}
    timeout = httpx.Timeout(0.3, connect=10.0) if job.kind == "client-timeout" else HTTP_TIMEOUT
    started = time.monotonic()
    out = Outcome(job, None, 0.0)
    try:
        with httpx.stream("POST", f"{url}/v1/{job.path}", content=content, headers=headers, timeout=timeout) as resp:
            out.status = resp.status_code
            if resp.status_code == 200 and job.stream:
                _read_stream(resp, out, chat, hang_up=job.kind == "hangup")
            else:
                body = json.loads(resp.read())
                if resp.status_code == 200:
                    choice = body["choices"][0]
                    out.text = choice["message"]["content"] if chat else choice["text"]
                    out.finish_reason = choice["finish_reason"]
                    out.completion_tokens = body["usage"]["completion_tokens"]
                else:
                    out.error = json.dumps(body.get("error"))
    except httpx.ReadTimeout as exc:
        out.error = f"ReadTimeout: {exc}"
    out.latency_s = time.monotonic() - started
    return out


def check(out: Outcome) -> str | None:
    """Why this outcome is wrong, or None."""
    job = out.job
    if out.latency_s > REQUEST_BOUND_S:
        return f"took {out.latency_s:.1f} s"
    if job.kind == "client-timeout":
        return None if out.status in (None, 200) else f"status {out.status}"
    if out.status != job.status:
        return f"status {out.status}, expected {job.status}: {out.error}"
    if job.kind == "bad":
        return None if out.error else "no error body"
    if out.error is not None:
        return f"error {out.error}"
    if job.kind == "hangup":
        return None
    want_reason = "length" if job.expected_tokens == job.body["max_tokens"] else "stop"
    got = (out.text, out.completion_tokens, out.finish_reason)
    if got != (job.expected_text, job.expected_tokens, want_reason):
        return f"got {got!r}, expected {(job.expected_text, job.expected_tokens, want_reason)!r}"
    return None


def run_phase(url: str, jobs: list[Job]) -> tuple[list[Outcome], float]:
    """All jobs at CONCURRENCY; fails (instead of hanging) if the phase does not end within RUN_BOUND_S."""
    started = time.monotonic()
    pool = concurrent.futures.ThreadPoolExecutor(CONCURRENCY)
    futures = [pool.submit(run_job, url, job) for job in jobs]
    _, pending = concurrent.futures.wait(futures, timeout=RUN_BOUND_S)
    pool.shutdown(wait=False, cancel_futures=True)
    assert not pending, f"{len(pending)} of {len(jobs)} requests still running after {RUN_BOUND_S} s"
    return [f.result() for f in futures], time.monotonic() - started


def drain(app, timeout_s: float = 90.0) -> None:
    """Wait until no request or per-sequence state is left anywhere; fail naming what is left."""
    deadline = time.monotonic() + timeout_s
    while (left := leftover_state(app)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        lines = httpx.get(f"{app.url}/metrics", headers=AUTH, timeout=HTTP_TIMEOUT).text.splitlines()
        prefixes = ("s2d:request_aborts", "s2d:request_errors", "s2d:spec_decode_draft_fallback")
        counters = [ln for ln in lines if ln.startswith(prefixes)]
        raise AssertionError(f"state left after {timeout_s} s: {left}; stats {app.handle.stats.remote().result()}; "
                             f"{counters}")


def leftover_state(app) -> dict:
    s = app.handle.stats.remote().result()
    out = {f"{n}.{k}": v for n, t in s["targets"].items() for k, v in
           (("running", t["running"]), ("waiting", t["waiting"]), ("kv", t["deployment"]["num_active"]))}
    out["draft.kv"] = s["draft"]["num_active"]
    return {k: v for k, v in out.items() if v}


@pytest.fixture(scope="module")
def refs(tiny_family) -> dict:
    def pair(key: str) -> dict:
        src = str(tiny_family[key])
        return {"greedy": Reference(src, "float64"),
                "sampled": Reference(src, "float64", draft=str(tiny_family["draft"]), spec=SPEC)}

    return {"tiny-a": pair("a"), "tiny-b": pair("b")}


def _fallback_rounds(app) -> float:
    return sum(metric(app.url, f's2d:spec_decode_draft_fallback_rounds_total{{model="{m}"}}') for m in MAX_PROMPT)


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def test_soak_loses_nothing_and_leaks_nothing(soak_app, refs):
    rng = random.Random(20240701)
    warmup, soak = plan(rng, refs, N_WARMUP), plan(rng, refs, N_SOAK)
    outs, _ = run_phase(soak_app.url, warmup)
    assert [check(o) for o in outs if check(o)] == []
    drain(soak_app)
    before = {d: replica_memory_mib(APP, d) for d in DEPLOYMENTS}
    fallbacks = _fallback_rounds(soak_app)

    # Two halves: caches and allocator arenas grow to a high-water mark set by how many sequences happened to run
    # together (timing-dependent), so the first half may grow; a leak is per request and grows again in the second.
    half = len(soak) // 2
    first, wall_1 = run_phase(soak_app.url, soak[:half])
    drain(soak_app)
    mid = {d: replica_memory_mib(APP, d) for d in DEPLOYMENTS}
    second, wall_2 = run_phase(soak_app.url, soak[half:])
    outs, wall_s = first + second, wall_1 + wall_2
    failures = [(o.job.kind, o.job.path, o.job.body if isinstance(o.job.body, dict) else o.job.body[:40], why)
                for o in outs if (why := check(o))]
    assert failures == [], failures[:5]
    statuses = [o.status for o in outs]
    assert not [s for s in statuses if s is not None and (s == 429 or s >= 500)]
    drain(soak_app)  # hang-ups and timeouts freed their KV too
    after = {d: replica_memory_mib(APP, d) for d in DEPLOYMENTS}
    # Speculation never degraded, so the sampled comparison above was against the same draft proposals.
    assert _fallback_rounds(soak_app) == fallbacks

    ok = [o.latency_s for o in outs if o.status == 200 and o.job.kind in ("greedy", "sampled")]
    kinds = {k: sum(o.job.kind == k for o in outs) for k in ("greedy", "sampled", "hangup", "client-timeout", "bad")}
    figures = {
        "requests": len(outs), "warmup_requests": len(warmup), "concurrency": CONCURRENCY, "kinds": kinds,
        "streamed": sum(o.job.stream for o in outs), "wall_s": round(wall_s, 1),
        "p50_s": round(_percentile(ok, 50), 3), "p99_s": round(_percentile(ok, 99), 3), "max_s": round(max(ok), 3),
        "statuses": {str(s): statuses.count(s) for s in sorted(set(statuses), key=str)},
        "generated_tokens": sum(o.completion_tokens or 0 for o in outs if o.job.kind in ("greedy", "sampled")),
        "memory_mib_before": {d: round(v, 1) for d, v in before.items()},
        "memory_mib_mid": {d: round(v, 1) for d, v in mid.items()},
        "memory_mib_after": {d: round(v, 1) for d, v in after.items()},
    }
    print("SOAK", json.dumps(figures))
    grown = {d: round(after[d] - mid[d], 1) for d in DEPLOYMENTS if after[d] - mid[d] > MEMORY_MARGIN_MIB}
    assert not grown, (grown, figures)
