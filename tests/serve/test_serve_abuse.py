"""One client's maximal legal requests do not stall the other streams of a router replica.

An app with the default limits (1 MiB bodies) serves a tiny float64 target. Two victim streams decode greedily
while a client sends, back to back, requests at the per-request bounds: 128 bad words of 128 characters with 300
logit biases, 64 stop ids and 4 stop strings of 256 characters (tokenizing, and per-round work on every row); a
`response_format` schema of ~60 KB (a grammar compile); 128 tools filling `max_schema_bytes` with a required call
(their text, ~58k tokens, is tokenized, then refused against the tiny model's context). The victims' median
inter-token latency while the client keeps sending (past its first requests: its steady state) stays within 1.5x of
the median without it, measured before and after, so a drift in a neighbour's load on the host falls on both sides.
Each bound one past its default gets a 400 naming the field, on the same app.
"""

from __future__ import annotations

import json
import random
import statistics
import string
import threading
import time

import httpx
import pytest

from reliability_helpers import delete_app, deploy_app
from serve_helpers import AUTH, HTTP_TIMEOUT, post

pytestmark = pytest.mark.serve

APP = "abuse"
VICTIMS = 2
VICTIM_TOKENS = 64
PHASES = 2  # victim phases before and after the abuser (and twice as many with it)
STEADY_S = 4.0
RATIO = 1.5
PHASE_BOUND_S = 120.0


@pytest.fixture(scope="module")
def abuse_app(serve_instance, tiny_family):
    from s2d_ray.serve import build_app

    cfg = {
        "targets": [{"name": "tiny-a", "source": str(tiny_family["a"]), "dtype": "float64", "num_cpus": 0.25,
                     "plain_steps": 1}],
        "spec": {"mode": "ar"},  # one token per round: each victim chunk is one inter-token gap
        "router": {"num_cpus": 0.25},
        "num_threads": 1,  # limits: the defaults (1 MiB bodies, every per-request bound at its default)
    }
    yield deploy_app(build_app(cfg), APP, serve_instance, cfg)
    delete_app(APP)


def _words(n: int, size: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(string.ascii_letters + "éü東🙂", k=size)) for _ in range(n)]


def _tools(n: int, budget: int) -> list[dict]:
    """n tools whose JSON comes close to `budget` bytes in all."""
    props_per_tool = 1
    while True:
        tools = [{"type": "function", "function": {
            "name": f"tool_{i}", "description": "d",
            "parameters": {"type": "object", "properties": {
                f"p{j}": {"type": "string", "maxLength": 8} for j in range(props_per_tool + 1)}}}}
            for i in range(n)]
        if len(json.dumps(tools, separators=(",", ":"))) > budget * 0.9:
            return [{"type": "function", "function": {
                "name": f"tool_{i}", "description": "d",
                "parameters": {"type": "object", "properties": {
                    f"p{j}": {"type": "string", "maxLength": 8} for j in range(props_per_tool)}}}}
                for i in range(n)]
        props_per_tool += 1


def _schema(budget: int) -> dict:
    """An object schema of string properties whose JSON comes close to `budget` bytes."""
    props = {f"p{j}": {"type": "string", "maxLength": 8} for j in range(budget // 40)}
    return {"type": "object", "properties": props}


def maximal_requests() -> list[tuple[str, dict, int]]:
    """Requests at every default per-request bound (app_config.Limits), with their status: the tools' text makes a
    prompt longer than the tiny model's context (a 400 after tokenizing it), the others are served."""
    penalties = {
        "model": "tiny-a", "prompt": "the quick brown fox " * 40, "max_tokens": 8, "temperature": 0,
        "bad_words": _words(128, 128, 0), "logit_bias": {str(i): 0.5 for i in range(300)},
        "stop_token_ids": list(range(256, 320)), "stop": _words(4, 256, 1),
        "frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.2,
    }
    tools = {
        "model": "tiny-a", "messages": [{"role": "user", "content": "call a tool " * 20}], "max_tokens": 8,
        "temperature": 0, "tools": _tools(128, 65536), "tool_choice": "required",
    }
    schema = {"model": "tiny-a", "prompt": "a record:", "max_tokens": 8, "temperature": 0,
              "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": _schema(60000)}}}
    return [("completions", penalties, 200), ("completions", schema, 200), ("chat/completions", tools, 400)]


def over_limit_requests() -> list[tuple[str, dict, str]]:
    """Each bound one past its default: (path, body, the field the 400 names)."""
    base = {"model": "tiny-a", "prompt": "hi", "max_tokens": 2}
    chat = {"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    schema = {"type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(3000)}}
    return [
        ("completions", {**base, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("completions", {**base, "stop": ["x" * 257]}, "stop"),
        ("completions", {**base, "stop_token_ids": list(range(65))}, "stop_token_ids"),
        ("completions", {**base, "bad_words": ["w"] * 129}, "bad_words"),
        ("completions", {**base, "bad_words": ["w" * 129]}, "bad_words"),
        ("completions", {**base, "logit_bias": {str(i): 1.0 for i in range(301)}}, "logit_bias"),
        ("chat/completions", {**chat, "tools": _tools(129, 20000)}, "tools"),
        ("chat/completions", {**chat, "tools": [  # 2 tools over max_schema_bytes
            {"type": "function", "function": {"name": f"f{i}", "parameters": schema}} for i in range(2)]}, "tools"),
        ("chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "r", "schema": schema}}}, "response_format"),
        ("completions", {**base, "structured_outputs": {"json": schema}}, "structured_outputs"),
    ]


def test_each_bound_past_its_default_is_a_400_naming_the_field(abuse_app):
    for path, body, field in over_limit_requests():
        t0 = time.monotonic()
        resp = post(f"{abuse_app.url}/v1/{path}", body)
        assert resp.status_code == 400, (field, resp.text[:300])
        assert resp.json()["error"]["param"] == field, resp.text[:300]
        assert time.monotonic() - t0 < 10.0  # refused on the fields, not after tokenizing or compiling
    for path, body, status in maximal_requests():  # the maximal legal ones are served
        resp = post(f"{abuse_app.url}/v1/{path}", body)
        assert resp.status_code == status, resp.text[:300]


def _victim(url: str, seed: int, gaps: list[float]) -> None:
    body = {"model": "tiny-a", "prompt": f"Victim {seed} counts:", "max_tokens": VICTIM_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    last = None
    with httpx.stream("POST", f"{url}/v1/completions", content=json.dumps(body),
                      headers={"content-type": "application/json", **AUTH}, timeout=HTTP_TIMEOUT) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now


def _victim_phase(url: str) -> list[float]:
    gaps: list[float] = []
    threads = [threading.Thread(target=_victim, args=(url, i, gaps)) for i in range(VICTIMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(PHASE_BOUND_S)
        assert not t.is_alive(), "a victim stream did not finish in time"
    assert len(gaps) >= VICTIMS * (VICTIM_TOKENS - 2)
    return gaps


class Abuser:
    """One client sending maximal legal requests back to back until stopped."""

    def __init__(self, url: str) -> None:
        self.url, self.stop, self.statuses, self.sent = url, threading.Event(), [], 0
        self.requests = maximal_requests()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        with httpx.Client(timeout=HTTP_TIMEOUT) as client:
            while not self.stop.is_set():
                path, body, status = self.requests[i % len(self.requests)]
                self.sent += 1
                resp = client.post(f"{self.url}/v1/{path}", content=json.dumps(body),
                                   headers={"content-type": "application/json", **AUTH})
                self.statuses.append((resp.status_code, status))
                i += 1

    def __enter__(self) -> "Abuser":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(PHASE_BOUND_S)
        assert not self.thread.is_alive()


def test_maximal_requests_do_not_slow_other_streams(abuse_app):
    url = abuse_app.url
    _victim_phase(url)  # warm-up: first rounds, the tokenizer's caches
    alone: list[float] = []
    abused: list[float] = []
    for _ in range(PHASES):
        alone += _victim_phase(url)
    with Abuser(url) as abuser:
        time.sleep(STEADY_S)  # past its first preparations: the steady state of a client that keeps sending
        for _ in range(2 * PHASES):
            abused += _victim_phase(url)
    for _ in range(PHASES):  # before and after: a neighbour's load on the host falls on both sides
        alone += _victim_phase(url)
    statuses = abuser.statuses
    base, loaded = statistics.median(alone), statistics.median(abused)
    print(f"ABUSE itl median alone {1000 * base:.2f} ms, with the abuser {1000 * loaded:.2f} ms "
          f"({loaded / base:.2f}x); abuser requests sent {abuser.sent}, answered {len(statuses)}, "
          f"statuses {sorted(set(g for g, _ in statuses))}")
    # The client was sending all along: a request answered and the next one in the server's hands (its heavy
    # preparations are paced: limits.prepare_share) while the victims were measured.
    assert abuser.sent >= 2 and len(statuses) >= 1
    assert all(got == want for got, want in statuses), statuses
    assert loaded <= RATIO * base, (base, loaded)
