"""Bad input over HTTP: the right 4xx with an OpenAI-style error body, and the server keeps serving."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

from serve_helpers import AUTH, HTTP_TIMEOUT, post

pytestmark = pytest.mark.serve

OK = {"model": "tiny-a", "prompt": "hello there", "max_tokens": 4, "temperature": 0}
CHAT_OK = {"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}

CASES = [
    # (id, path, body, status, param)
    ("invalid-json", "completions", b'{"model": "tiny-a", "prompt": ', 400, None),
    ("not-an-object", "completions", b'[1, 2, 3]', 400, None),
    ("unknown-model", "completions", {**OK, "model": "gpt-17"}, 404, "model"),
    ("missing-model", "completions", {"prompt": "x"}, 400, "model"),
    ("missing-prompt", "completions", {"model": "tiny-a"}, 400, "prompt"),
    ("empty-prompt", "completions", {**OK, "prompt": ""}, 400, None),
    ("blank-prompt", "completions", {**OK, "prompt": "   "}, 400, None),
    ("empty-prompt-list", "completions", {**OK, "prompt": []}, 400, None),
    ("token-out-of-vocab", "completions", {**OK, "prompt": [5, 99999]}, 400, None),
    ("negative-token-echo", "completions", {**OK, "prompt": [-1], "echo": True}, 400, None),  # echo decodes ids
    ("max-tokens-zero", "completions", {**OK, "max_tokens": 0}, 400, None),  # 0 only with echo
    ("max-tokens-negative", "completions", {**OK, "max_tokens": -3}, 400, "max_tokens"),
    ("max-tokens-over-limit", "completions", {**OK, "max_tokens": 449}, 400, None),
    ("prompt-over-limit", "completions", {**OK, "prompt": [5] * 401}, 400, None),
    ("prompt-over-context", "completions", {**OK, "model": "tiny-b", "prompt": [5] * 200}, 400, None),
    ("prompt-plus-max-tokens-over-context", "completions",
     {**OK, "model": "tiny-b", "prompt": [5] * 100, "max_tokens": 40}, 400, None),
    ("temperature-high", "completions", {**OK, "temperature": 2.5}, 400, "temperature"),
    ("temperature-negative", "completions", {**OK, "temperature": -0.1}, 400, "temperature"),
    ("top-p-zero", "completions", {**OK, "top_p": 0}, 400, "top_p"),
    ("top-p-high", "completions", {**OK, "top_p": 1.5}, 400, "top_p"),
    ("max-tokens-string", "completions", {**OK, "max_tokens": "5"}, 400, "max_tokens"),
    ("max-tokens-float", "completions", {**OK, "max_tokens": 5.5}, 400, "max_tokens"),
    ("max-tokens-bool", "completions", {**OK, "max_tokens": True}, 400, "max_tokens"),
    ("temperature-string", "completions", {**OK, "temperature": "hot"}, 400, "temperature"),
    ("prompt-number", "completions", {**OK, "prompt": 42}, 400, "prompt"),
    ("stream-string", "completions", {**OK, "stream": "yes"}, 400, "stream"),
    ("n-zero", "completions", {**OK, "n": 0}, 400, "n"),
    ("n-over-limit", "completions", {**OK, "n": 7}, 400, "n"),
    ("batch-times-n-over-limit", "completions", {**OK, "prompt": ["a", "b", "c", "d"], "n": 2}, 400, "n"),
    ("best-of", "completions", {**OK, "n": 1, "best_of": 2}, 400, None),
    ("logprobs-negative", "completions", {**OK, "logprobs": -1}, 400, "logprobs"),
    ("logprobs-over-limit", "completions", {**OK, "logprobs": 21}, 400, None),
    ("logprobs-string", "completions", {**OK, "logprobs": "5"}, 400, "logprobs"),
    ("echo-prompt-over-limit", "completions", {**OK, "prompt": [5] * 65, "echo": True, "logprobs": 0}, 400, None),
    ("empty-prompt-in-batch", "completions", {**OK, "prompt": [[5, 6], []]}, 400, None),
    ("mixed-batch", "completions", {**OK, "prompt": [[5, 6], "a"]}, 400, "prompt"),
    ("chat-top-logprobs-over-limit", "chat/completions", {**CHAT_OK, "logprobs": True, "top_logprobs": 21}, 400,
     None),
    ("chat-top-logprobs-without-logprobs", "chat/completions", {**CHAT_OK, "top_logprobs": 2}, 400, None),
    ("chat-logprobs-int", "chat/completions", {**CHAT_OK, "logprobs": 3}, 400, "logprobs"),
    ("too-many-stops", "completions", {**OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("stop-too-long", "completions", {**OK, "stop": ["x" * 257]}, 400, "stop"),
    ("too-many-stop-token-ids", "completions", {**OK, "stop_token_ids": list(range(65))}, 400, "stop_token_ids"),
    ("too-many-bad-words", "completions", {**OK, "bad_words": ["w"] * 129}, 400, "bad_words"),
    ("bad-word-too-long", "chat/completions", {**CHAT_OK, "bad_words": ["w" * 129]}, 400, "bad_words"),
    ("too-many-logit-biases", "completions", {**OK, "logit_bias": {str(i): 1 for i in range(301)}}, 400,
     "logit_bias"),
    ("chat-no-messages", "chat/completions", {**CHAT_OK, "messages": []}, 400, "messages"),
    ("chat-messages-string", "chat/completions", {**CHAT_OK, "messages": "hi"}, 400, "messages"),
    ("chat-bad-role", "chat/completions", {**CHAT_OK, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages"),
    ("chat-empty-content", "chat/completions", {**CHAT_OK, "messages": [{"role": "user", "content": " "}]}, 400,
     None),
    ("chat-unknown-model", "chat/completions", {**CHAT_OK, "model": "nope"}, 404, "model"),
    ("chat-max-tokens-zero", "chat/completions", {**CHAT_OK, "max_tokens": 0}, 400, "max_tokens"),
    ("body-too-large", "completions", {**OK, "prompt": "x" * 5000}, 413, None),
]


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_openai_4xx(tiny_app, case):
    _, path, body, status, param = case
    err = assert_openai_error(post(f"{tiny_app.url}/v1/{path}", body), status, param)
    if status == 400:
        assert err["type"] == "invalid_request_error"


def test_streaming_bad_input_gets_status_not_stream(tiny_app):
    resp = post(f"{tiny_app.url}/v1/completions", {**OK, "model": "nope", "stream": True})
    assert_openai_error(resp, 404, "model")


def test_api_key_required(tiny_app):
    url = f"{tiny_app.url}/v1/completions"
    for headers in ({"authorization": ""}, {"authorization": "Bearer wrong"}, {"authorization": "Basic abc"}):
        err = assert_openai_error(post(url, OK, headers=headers), 401)
        assert err["type"] == "authentication_error"
    resp = httpx.get(f"{tiny_app.url}/v1/models", timeout=HTTP_TIMEOUT)
    assert_openai_error(resp, 401)
    models = httpx.get(f"{tiny_app.url}/v1/models", headers=AUTH, timeout=HTTP_TIMEOUT).json()
    assert [m["id"] for m in models["data"]] == ["tiny-a", "tiny-b", "tiny-tp"]


def test_unknown_route_and_method(tiny_app):
    assert_openai_error(httpx.get(f"{tiny_app.url}/v1/nothing", headers=AUTH, timeout=HTTP_TIMEOUT), 404)
    assert_openai_error(httpx.get(f"{tiny_app.url}/v1/completions", headers=AUTH, timeout=HTTP_TIMEOUT), 405)


def test_queue_limit_gives_429_and_others_succeed(tiny_app):
    """4 running + 4 queued per target: a burst of 14 long requests gets some 429s (with Retry-After), the admitted
    ones finish."""
    body = {**OK, "prompt": "The quick brown fox", "max_tokens": 64}
    with concurrent.futures.ThreadPoolExecutor(14) as pool:
        resps = list(pool.map(lambda _: post(f"{tiny_app.url}/v1/completions", body), range(14)))
    codes = [r.status_code for r in resps]
    assert codes.count(429) >= 1, codes
    assert all(r.headers.get("retry-after") == "1" for r in resps if r.status_code == 429)
    assert codes.count(200) >= 8, codes
    assert set(codes) <= {200, 429}


def test_server_keeps_serving_after_bad_input(tiny_app):
    for body in (b"{", {**OK, "max_tokens": -1}, {**OK, "model": "x"}):
        post(f"{tiny_app.url}/v1/completions", body)
    resp = post(f"{tiny_app.url}/v1/completions", OK)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(f"{tiny_app.url}/health", timeout=HTTP_TIMEOUT).json()["status"] == "ok"


FUZZ_KEYS = ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stop", "seed",
             "logprobs", "echo", "user", "extra"]


def _fuzz_bodies():
    """Raw bodies: JSON objects mixing the request's fields with values of every type, or random bytes."""
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(), st.text(max_size=8),
                        st.lists(st.integers(-3, 400), max_size=4))
    values = st.one_of(scalars, st.lists(scalars, max_size=3),
                       st.dictionaries(st.text(max_size=5), scalars, max_size=3))
    fields = st.dictionaries(st.sampled_from(FUZZ_KEYS), values, max_size=6)
    model = st.sampled_from(["tiny-a", "nope", 3])
    small_max = st.integers(-2, 3)  # keeps valid requests short
    objects = st.builds(lambda f, m, k: {**f, "model": m, "max_tokens": k}, fields, model, small_max)
    return st.one_of(objects.map(lambda b: json.dumps(b).encode()), st.binary(max_size=64))


def test_fuzzed_bodies_never_get_5xx(tiny_app):
    """Random JSON objects over the request fields, and random bytes: always an answer, never a 5xx."""
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(_fuzz_bodies())
    def check(raw: bytes) -> None:
        for path in ("completions", "chat/completions"):
            resp = post(f"{tiny_app.url}/v1/{path}", raw)
            assert resp.status_code < 500, (raw, resp.text)
            if resp.status_code != 200:
                assert set(resp.json()["error"]) == {"message", "type", "param", "code"}

    check()
    assert post(f"{tiny_app.url}/v1/completions", OK).status_code == 200
