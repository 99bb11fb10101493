"""Shared by the serve tests: in-process target-only greedy (the reference), HTTP calls and SSE parsing."""

from __future__ import annotations

import json
import time

import httpx

from s2d_ray.build import build_engine
from s2d_ray.config import DraftConfig, EngineConfig, SpecConfig, TargetConfig
from s2d_ray.core.engine import GenerationRequest
from s2d_ray.core.types import SamplingParams
from s2d_ray.prompts import encode_messages, encode_prompt

HTTP_TIMEOUT = httpx.Timeout(120.0, connect=10.0)


class Reference:
    """Target-only greedy decoding in this process with the same loader: what the served output must equal."""

    def __init__(self, source: str, dtype: str, draft: str | None = None, spec: dict | None = None) -> None:
        """Target-only by default; with `draft` (and `spec`), in-process S2D with that draft."""
        cfg = EngineConfig(target=TargetConfig(name="ref", source=source, dtype=dtype),
                           draft=DraftConfig(source=draft or "unused"),
                           spec=SpecConfig(**(spec or {"mode": "ar"})), num_threads=1)
        self.built = build_engine(cfg)
        self.tok = self.built.target.tokenizer
        self._n = 0

    def ids(self, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
        return encode_messages(self.tok, messages) if messages else encode_prompt(self.tok, prompt, chat=False)

    def greedy(self, prompt_ids: list[int], max_tokens: int, params: SamplingParams = SamplingParams()) -> list[int]:
        self._n += 1
        req = GenerationRequest(f"ref{self._n}", prompt_ids, max_tokens, params,
                                stop_token_ids=(self.tok.eos_token_id,))
        return self.built.engine.generate([req])[0].token_ids

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


API_KEY = "test-key-0123"
AUTH = {"authorization": f"Bearer {API_KEY}"}


def post(url: str, body: dict | bytes | str, headers: dict | None = None) -> httpx.Response:
    """POST JSON (or raw bytes/str) with the test API key unless `headers` says otherwise."""
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    hdrs = {"content-type": "application/json", **AUTH, **(headers or {})}
    return httpx.post(url, content=content, headers=hdrs, timeout=HTTP_TIMEOUT)


def sse_events(url: str, body: dict) -> list[dict | str]:
    """POST with stream=True and parse `data: ...` events ("[DONE]" kept as a string)."""
    events: list[dict | str] = []
    hdrs = {"content-type": "application/json", **AUTH}
    with httpx.stream("POST", url, content=json.dumps({**body, "stream": True}), headers=hdrs,
                      timeout=HTTP_TIMEOUT) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def wait_until(predicate, timeout_s: float = 30.0, interval_s: float = 0.2):
    """Poll until predicate() returns a truthy value; return it, or fail with the last value."""
    deadline = time.monotonic() + timeout_s
    value = None
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s} s (last value {value!r})")


def replica_actor(app: str, deployment: str):
    """The live Ray actor of a deployment's (single) replica."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{app}#{deployment}#")]
    assert len(names) == 1, names
    return ray.get_actor(names[0], namespace="serve")
