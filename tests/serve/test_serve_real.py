"""The real SmolLM2-135M-Instruct served on Ray: greedy output over HTTP equals in-process target-only greedy."""

from __future__ import annotations

import pytest

from serve_helpers import Reference, post

pytestmark = [pytest.mark.serve, pytest.mark.real]


@pytest.fixture(scope="module")
def ref() -> Reference:
    return Reference("smollm2-135m-instruct", "float32")


def test_real_chat_greedy_over_http_equals_in_process(real_app, ref):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    body = {"model": "smollm2-135m-instruct", "messages": messages, "max_tokens": 24, "temperature": 0}
    resp = post(f"{real_app.url}/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    expected = ref.greedy(ref.ids(messages=messages), 24)
    assert out["choices"][0]["message"]["content"] == ref.text(expected)
    assert out["usage"]["completion_tokens"] == len(expected)
    spec = out["metrics"]["speculative_decoding"]
    assert spec["num_draft_tokens"] > 0 and spec["num_target_forwards"] >= 1


@pytest.mark.tp
def test_real_tp3_equals_tp1(real_tp_app, ref):
    from s2d_ray.serve.openai_protocol import GenerateRequest

    stats = real_tp_app.handle.stats.remote().result()["targets"]["smollm2-tp3"]["deployment"]
    assert stats["tp_size"] == 3 and len({r["pid"] for r in stats["ranks"]}) == 3
    prompt = "The three primary colors are"
    resp = real_tp_app.handle.generate.remote(
        GenerateRequest(model="smollm2-tp3", prompt=prompt, max_tokens=16)).result()
    assert resp.token_ids == ref.greedy(ref.ids(prompt), 16)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 16}},
                                                "required": ["city"], "additionalProperties": False}}}


def _chat(app, content: str, **body) -> dict:
    resp = post(f"{app.url}/v1/chat/completions", {"model": "smollm2-135m-instruct", "temperature": 0,
                                                   "max_tokens": 40, "messages": [{"role": "user", "content": content}],
                                                   **body})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def test_real_json_schema_validates_and_equals_plain_constrained(real_app):
    import json

    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    spec = _chat(real_app, "Invent a person as JSON.", response_format=fmt)
    plain = _chat(real_app, "Invent a person as JSON.", response_format=fmt, speculate=False)
    assert spec["message"]["content"] == plain["message"]["content"]
    jsonschema.validate(json.loads(spec["message"]["content"]), PERSON)


def test_real_named_tool_call_validates(real_app):
    import json

    import jsonschema

    choice = _chat(real_app, "What is the weather in Paris?", tools=[WEATHER],
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])


def test_real_several_tool_calls_parallel_and_not(real_app):
    """Asked for the weather in two cities, SmolLM2 under `required` calls the tool once per city when
    parallel_tool_calls allows it (the default), and once only when it is false (the control); the calls equal plain
    target decoding's (`speculate: false`, the grammar applied the same way) and the openai SDK's stream helper
    accumulates the same calls from the stream."""
    import openai

    from serve_helpers import API_KEY

    ask = "What is the weather in Paris and in Oslo? Call the tool once for each city."
    fields = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 80}

    def calls(choice: dict) -> list[tuple[str, str]]:
        return [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]

    many = _chat(real_app, ask, **fields)
    expected = [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Oslo"}')]
    assert many["finish_reason"] == "tool_calls" and calls(many) == expected
    assert len({c["id"] for c in many["message"]["tool_calls"]}) == 2
    assert calls(_chat(real_app, ask, speculate=False, **fields)) == expected
    one = _chat(real_app, ask, parallel_tool_calls=False, **fields)
    assert one["finish_reason"] == "tool_calls" and calls(one) == expected[:1]
    client = openai.OpenAI(base_url=f"{real_app.url}/v1", api_key=API_KEY, timeout=120, max_retries=0)
    with client.chat.completions.stream(model="smollm2-135m-instruct", messages=[{"role": "user", "content": ask}],
                                        temperature=0, **fields) as stream:
        final = stream.get_final_completion().choices[0]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == expected
    assert final.finish_reason == "tool_calls"
