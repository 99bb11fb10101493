"""Fuzzing the HTTP API of the tiny app: schemathesis cases generated from the router's own `/openapi.json` (valid
and schema-violating bodies for every operation), and hand-made nasty bodies (deep nesting, huge and non-finite
numbers, odd encodings, unicode, denormal temperatures). Never a 5xx; the server keeps serving and holds no state."""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import pytest

from serve_helpers import AUTH, HTTP_TIMEOUT, post, wait_until

pytestmark = pytest.mark.serve

OK = {"model": "tiny-a", "prompt": "hello there", "max_tokens": 4, "temperature": 0}
CHAT = {"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
CASE_BOUND_S = 60.0  # one generated case, answered (a schema-valid body may ask for up to 448 tokens)


def _raw(body: dict, **extra) -> bytes:
    return json.dumps({**body, **extra}).encode()


NASTY = [  # (id, path, raw body, status)
    ("nested-array-2000", "completions", b"[" * 2000 + b"]" * 2000, 400),
    ("nested-object-in-field", "completions", _raw(OK)[:-1] + b', "x": ' + b'{"a":' * 500 + b"1" + b"}" * 501, 400),
    ("nested-list-prompt", "completions", _raw(OK)[:-1].replace(b'"hello there"', b"[" * 500 + b"]" * 500) + b"}",
     400),
    ("nested-messages", "chat/completions", _raw(CHAT, messages=[{"role": "user", "content": [[[[[]]]]]}]), 400),
    ("huge-int-max-tokens", "completions", _raw(OK, max_tokens=10**40), 400),
    ("huge-int-seed", "completions", _raw(OK, seed=2**200, temperature=1.0), 200),
    ("negative-seed", "completions", _raw(OK, seed=-(2**70), temperature=1.0), 200),
    ("huge-top-k", "completions", _raw(OK, top_k=10**30, temperature=1.0), 200),
    ("huge-token-id", "completions", _raw(OK, prompt=[10**30]), 400),
    ("float-overflow", "completions", _raw(OK)[:-1] + b', "temperature": 1e400}', 400),
    ("nan", "completions", _raw(OK)[:-1] + b', "temperature": NaN}', 400),
    ("infinity", "completions", _raw(OK)[:-1] + b', "top_p": -Infinity}', 400),
    ("denormal-temperature", "completions", _raw(OK, temperature=5e-324, seed=1), 200),
    ("tiny-temperature", "completions", _raw(OK, temperature=1e-300, top_p=1e-300), 200),
    ("lone-surrogate", "completions", b'{"model": "tiny-a", "prompt": "\\ud800x", "max_tokens": 2}', 400),
    ("lone-surrogate-chat", "chat/completions",
     b'{"model": "tiny-a", "messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', 400),
    ("utf8-bom", "completions", b"\xef\xbb\xbf" + _raw(OK), 400),
    ("latin-1", "completions", _raw(OK).replace(b"hello", b"h\xe9llo"), 400),
    ("utf-16", "completions", json.dumps(OK).encode("utf-16"), 400),
    ("nul-bytes", "completions", _raw(OK, prompt="a\x00b\x00"), 200),
    ("emoji-and-rtl", "completions", _raw(OK, prompt="\U0001f642\u202e\u05d0\u0628" * 20, stop=["\U0001f642"]), 200),
    ("zero-width-only", "completions", _raw(OK, prompt="\u200b\u200b\u200b"), 200),
    ("special-token-text", "completions", _raw(OK, prompt="<|endoftext|><|im_start|>"), 200),
    ("duplicate-keys", "completions", b'{"model": "nope", "model": "tiny-a", "prompt": "x", "max_tokens": 2}', 200),
    ("empty-body", "completions", b"", 400),
    ("json-null", "completions", b"null", 400),
    ("json-string", "chat/completions", b'"hello"', 400),
    ("stop-null-item", "completions", _raw(OK, stop=[None]), 400),
    ("content-parts-image", "chat/completions",
     _raw(CHAT, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]), 400),
    ("prompt-list-of-float-lists", "completions", _raw(OK, prompt=[[1, 2], [3.5]]), 400),  # [[1, 2], [3]] is a batch
    ("max-tokens-as-float-string", "completions", _raw(OK, max_tokens="1e3"), 400),
]


@pytest.mark.parametrize("case", NASTY, ids=[c[0] for c in NASTY])
def test_nasty_bodies_get_their_status(tiny_app, case):
    _, path, raw, status = case
    resp = post(f"{tiny_app.url}/v1/{path}", raw)
    assert resp.status_code == status, resp.text
    if status != 200:
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_tiny_temperatures_decode_greedily(tiny_app):
    """Temperatures below 1e-5 (down to the smallest denormal) are greedy instead of NaN probabilities, which would
    have failed the round of every sequence on the target."""
    url = f"{tiny_app.url}/v1/completions"
    body = {**OK, "prompt": "The quick brown fox", "max_tokens": 12}
    greedy = post(url, body).json()["choices"][0]["text"]
    for model in ("tiny-a", "tiny-tp"):  # float64 and float32 (TP) targets
        expected = post(url, {**body, "model": model}).json()["choices"][0]["text"]
        for t in (5e-324, 1e-300, 1e-40, 9.9e-6):
            resp = post(url, {**body, "model": model, "temperature": t, "seed": 7})
            assert resp.status_code == 200, (model, t, resp.text)
            assert resp.json()["choices"][0]["text"] == expected, (model, t)
    assert expected == greedy  # tiny-tp is a TP copy of tiny-a


def _schema_cases(schema_doc: dict):
    """(operation, hypothesis strategy of (case, model override, send key)) for every operation and both modes."""
    import schemathesis
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(schema_doc)
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode == GenerationMode.NEGATIVE and op.method.lower() != "post":
                continue  # the GET operations take no input that could violate the schema
            # Mostly a served model and the right key, so that bodies get past auth and model lookup.
            extras = st.tuples(st.sampled_from(["tiny-a", "tiny-b", "tiny-tp", None]),
                               st.sampled_from([True, True, True, False]))
            yield op, mode, st.tuples(op.as_strategy(generation_mode=mode), extras)


def test_openapi_schema_fuzz_never_5xx(tiny_app):
    """schemathesis bodies for each operation of /openapi.json (valid ones, half of them aimed at a served model,
    and schema violations), with and without the key: always an answer below 500 with OpenAI's error shape."""
    from hypothesis import HealthCheck, given, settings

    doc = httpx.get(f"{tiny_app.url}/openapi.json", timeout=HTTP_TIMEOUT).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(doc["paths"])
    seen: Counter = Counter()
    slowest = [0.0]
    for op, mode, strategy in _schema_cases(doc):
        examples = (60 if mode.value == "positive" else 30) if op.method.lower() == "post" else 5

        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        @given(strategy)
        def check(drawn) -> None:
            case, (model, with_key) = drawn
            if model is not None and isinstance(case.body, dict):
                case.body["model"] = model
            started = time.monotonic()
            resp = case.call(base_url=tiny_app.url, headers=AUTH if with_key else {}, timeout=120)
            slowest[0] = max(slowest[0], time.monotonic() - started)
            assert time.monotonic() - started < CASE_BOUND_S, (op.path, case.body)  # no hang
            seen[(op.path, mode.value, resp.status_code)] += 1
            assert resp.status_code < 500, (op.path, case.body, resp.text[:300])
            if resp.status_code >= 400:
                assert set(resp.json()["error"]) == {"message", "type", "param", "code"}, resp.text[:300]

        check()
    print("FUZZ", json.dumps({f"{p} {m} {s}": n for (p, m, s), n in sorted(seen.items())}),
          f"slowest {slowest[0]:.1f} s")
    assert sum(n for (p, _, s), n in seen.items() if s == 200 and p.endswith("completions")) >= 5  # some were valid
    assert post(f"{tiny_app.url}/v1/completions", OK).status_code == 200

    def idle() -> bool:
        stats = tiny_app.handle.stats.remote().result()
        return stats["draft"]["num_active"] == 0 and all(
            t["running"] == 0 and t["deployment"]["num_active"] == 0 for t in stats["targets"].values())

    wait_until(idle, timeout_s=60)
