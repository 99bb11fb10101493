"""Per-request work bounds (serve/request_limits.py): each Limits field lets a request at the bound through and
refuses one past it with a RequestError naming the request field, for the OpenAI requests and the handle API's."""

from __future__ import annotations

import pytest

from s2d_ray.errors import RequestError
from s2d_ray.serve.app_config import Limits
from s2d_ray.serve.openai_protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from s2d_ray.serve.request_limits import check_request_limits

LIMITS = Limits(max_stop_strings=3, max_stop_chars=10, max_stop_token_ids=5, max_bad_words=4, max_bad_word_chars=6,
                max_logit_bias=7, max_tools=3, max_schema_bytes=400)  # JSON sizes without nulls


def _tool(i: int, props: int = 1) -> dict:
    params = {"type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(props)}}
    return {"type": "function", "function": {"name": f"f{i}", "parameters": params}}


def _schema(props: int) -> dict:
    return {"type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(props)}}


# (field, value at the bound, value one past it); the sizes are LIMITS' above.
CASES = [
    ("stop", ["a", "b", "c"], ["a", "b", "c", "d"]),
    ("stop", ["x" * 10], ["x" * 11]),
    ("stop_token_ids", [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]),
    ("bad_words", ["w1", "w2", "w3", "w4"], ["w1", "w2", "w3", "w4", "w5"]),
    ("bad_words", ["abcdef"], ["abcdefg"]),
    ("logit_bias", {str(i): 1.0 for i in range(7)}, {str(i): 1.0 for i in range(8)}),
]
CHAT_CASES = [
    ("tools", [_tool(i) for i in range(3)], [_tool(i) for i in range(4)]),
    ("tools", [_tool(0, 10)], [_tool(0, 14)]),  # within the count, past the schema size
    ("response_format", {"type": "json_schema", "json_schema": {"name": "r", "schema": _schema(10)}},
     {"type": "json_schema", "json_schema": {"name": "r", "schema": _schema(14)}}),
    ("structured_outputs", {"json": _schema(12)}, {"json": _schema(17)}),
    ("structured_outputs", {"regex": "a" * 380}, {"regex": "a" * 420}),
]
COMPLETION = {"model": "m", "prompt": "hi"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _refused(req, field: str) -> None:
    with pytest.raises(RequestError) as info:
        check_request_limits(req, LIMITS)
    assert info.value.param == field, info.value


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_sampling_bounds_at_and_past_the_limit(case):
    field, ok, over = case
    for body in (COMPLETION, CHAT):
        kind = CompletionRequest if "prompt" in body else ChatCompletionRequest
        check_request_limits(kind.model_validate({**body, field: ok}), LIMITS)
        _refused(kind.model_validate({**body, field: over}), field)
    check_request_limits(GenerateRequest.model_validate({**COMPLETION, field: ok}), LIMITS)  # the handle API too
    _refused(GenerateRequest.model_validate({**COMPLETION, field: over}), field)


@pytest.mark.parametrize("case", CHAT_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CHAT_CASES)])
def test_schema_bounds_at_and_past_the_limit(case):
    field, ok, over = case
    check_request_limits(ChatCompletionRequest.model_validate({**CHAT, field: ok}), LIMITS)
    _refused(ChatCompletionRequest.model_validate({**CHAT, field: over}), field)
    _refused(GenerateRequest.model_validate({**CHAT, field: over}), field)


def test_defaults_are_the_documented_ones_and_validated():
    d = Limits()
    assert (d.max_stop_strings, d.max_stop_chars, d.max_stop_token_ids, d.max_bad_words, d.max_bad_word_chars,
            d.max_logit_bias, d.max_tools, d.max_schema_bytes) == (4, 256, 64, 128, 128, 300, 128, 65536)
    for field, bad in (("max_stop_chars", 0), ("max_tools", -1), ("max_schema_bytes", 10)):
        with pytest.raises(ValueError, match=field):
            Limits(**{field: bad})
    check_request_limits(CompletionRequest.model_validate({**COMPLETION, "stop": ["a"] * 4}), d)
    with pytest.raises(RequestError, match="stop has 5 entries; the limit is 4"):
        check_request_limits(CompletionRequest.model_validate({**COMPLETION, "stop": ["a"] * 5}), d)


def test_heavy_requests_are_those_whose_preparation_may_take_long():
    from s2d_ray.serve.request_limits import LIGHT_TEXT_CHARS, heavy_request

    light = [COMPLETION, {**COMPLETION, "prompt": "x" * LIGHT_TEXT_CHARS}, {**COMPLETION, "stop": ["a"]},
             {"model": "m", "prompt_token_ids": [1] * 100}, CHAT, {**CHAT, "response_format": {"type": "text"}}]
    heavy = [{**COMPLETION, "prompt": "x" * (LIGHT_TEXT_CHARS + 1)}, {**COMPLETION, "bad_words": ["w"]},
             {**COMPLETION, "structured_outputs": {"regex": "a+"}}, {"model": "m", "prompt_token_ids": [1] * 5000},
             {**CHAT, "tools": [_tool(0)]}, {**CHAT, "response_format": {"type": "json_object"}},
             {**CHAT, "messages": [{"role": "user", "content": "y" * 3000}] * 2}]
    assert not any(heavy_request(GenerateRequest.model_validate(b)) for b in light)
    assert all(heavy_request(GenerateRequest.model_validate(b)) for b in heavy)


def test_a_schema_check_is_cached_by_its_text():
    """A client sending the same tools each turn pays the pure-Python schema check once (it is the bulk of a tool
    request's preparation); an invalid schema is refused from the cache too."""
    from s2d_ray.structured.grammars import _schema_error, check_json_schema

    schema = {"type": "object", "properties": {"cached_probe": {"type": "string"}}}
    before = _schema_error.cache_info()
    check_json_schema(schema, "tools")
    check_json_schema(dict(schema), "tools")
    after = _schema_error.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)
    for _ in range(2):
        with pytest.raises(RequestError, match="invalid JSON schema"):
            check_json_schema({"type": "object", "properties": {"x": {"type": 5}}}, "tools")
