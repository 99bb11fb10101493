"""OpenAI / vLLM request fields over real Ray Serve (127.0.0.1, tiny float64 target behind the S2D draft): penalties
equal in-process plain decoding with the same processors, logit_bias bans and forces, min_tokens, stop_token_ids and
ignore_eos act, json_schema output parses, validates and equals `speculate: false`, structured_outputs and tools
constrain the output (tool_calls, streamed too), and each bad value is a 400 naming its field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from s2d_ray.serve.openai_protocol import GenerateRequest
from serve_helpers import Reference, post, sse_events

pytestmark = pytest.mark.serve

PROMPT = "The quick brown fox"
EOS = 2  # the tiny tokenizer's <|im_end|>
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def ref(tiny_family) -> Reference:
    return Reference(str(tiny_family["a"]), "float64")


def complete(app, **body) -> dict:
    r = post(f"{app.url}/v1/completions", {"model": "tiny-a", "prompt": PROMPT, "temperature": 0, "max_tokens": 16,
                                          "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def chat(app, **body) -> dict:
    r = post(f"{app.url}/v1/chat/completions", {"model": "tiny-a", "temperature": 0, "max_tokens": 48,
                                               "messages": [{"role": "user", "content": "Give me a person."}], **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_penalties_equal_plain_decoding_with_the_same_processors(tiny_app, ref):
    from s2d_ray.core.engine import GenerationRequest
    from s2d_ray.core.penalties import PenaltySpec, penalty_processors

    fields = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.3}
    ids = ref.ids(PROMPT)
    spec = PenaltySpec(**fields)
    req = GenerationRequest("pen", ids, 32, stop_token_ids=(EOS,),
                            processors=tuple(penalty_processors(spec, len(ids), (EOS,))))
    expected = ref.built.engine.generate([req])[0].token_ids
    served = complete(tiny_app, max_tokens=32, **fields)
    assert served["token_ids"] == expected
    assert complete(tiny_app, max_tokens=32, speculate=False, **fields)["token_ids"] == expected
    assert complete(tiny_app, max_tokens=32)["token_ids"] != expected  # the penalties changed the output


def test_logit_bias_bans_and_forces_and_stop_fields_act(tiny_app):
    plain = complete(tiny_app)["token_ids"]
    banned = complete(tiny_app, logit_bias={str(plain[0]): -100})["token_ids"]
    assert banned[0] != plain[0]
    forced = 100 if plain[0] != 100 else 101
    assert complete(tiny_app, logit_bias={str(forced): 100})["token_ids"] == [forced] * 16
    ends = complete(tiny_app, logit_bias={str(EOS): 100})
    assert ends["finish_reason"] == "stop" and len(ends["token_ids"]) <= 1
    held = complete(tiny_app, logit_bias={str(EOS): 100}, min_tokens=5)
    assert held["finish_reason"] == "stop" and len([t for t in held["token_ids"] if t != EOS]) == 5
    ignored = complete(tiny_app, logit_bias={str(EOS): 100}, ignore_eos=True, max_tokens=6)
    assert ignored["finish_reason"] == "length"
    stop_at = plain[3]
    stopped = complete(tiny_app, stop_token_ids=[stop_at])
    first = plain.index(stop_at)
    assert stopped["finish_reason"] == "stop" and stopped["token_ids"][:first] == plain[:first]
    assert len(stopped["token_ids"]) <= first + 1


def test_json_schema_output_validates_and_equals_plain(tiny_app):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    spec = chat(tiny_app, response_format=fmt)
    plain = chat(tiny_app, response_format=fmt, speculate=False)
    text = spec["choices"][0]["message"]["content"]
    assert text == plain["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), SCHEMA)
    assert spec["metrics"]["speculative_decoding"]["num_draft_tokens"] > 0
    streamed = sse_events(f"{tiny_app.url}/v1/chat/completions", {
        "model": "tiny-a", "temperature": 0, "max_tokens": 48, "response_format": fmt,
        "messages": [{"role": "user", "content": "Give me a person."}]})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed[:-1]) == text
    assert isinstance(json.loads(chat(tiny_app, response_format={"type": "json_object"})["choices"][0]["message"]
                                 ["content"]), dict)
    handle = GenerateRequest(model="tiny-a", messages=[{"role": "user", "content": "Give me a person."}],
                             max_tokens=48, response_format=fmt)
    assert tiny_app.handle.generate.remote(handle).result().text == text  # the handle API honours it too


def test_structured_outputs_regex_and_choice(tiny_app):
    text = complete(tiny_app, structured_outputs={"regex": "[0-9]{3}-[a-c]{2}"})["text"]
    assert re.fullmatch("[0-9]{3}-[a-c]{2}", text), text
    assert complete(tiny_app, structured_outputs={"choice": ["red", "green", "blue"]})["text"] in ("red", "green",
                                                                                                   "blue")


def test_tools_produce_tool_calls(tiny_app):
    named = chat(tiny_app, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "weather"}})
    choice = named["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    required = chat(tiny_app, tools=[WEATHER], tool_choice="required")["choices"][0]
    assert required["message"]["tool_calls"][0]["function"]["name"] == "weather"
    auto = chat(tiny_app, tools=[WEATHER])["choices"][0]["message"]
    assert (auto["content"] is None) == bool(auto.get("tool_calls"))
    events = sse_events(f"{tiny_app.url}/v1/chat/completions", {
        "model": "tiny-a", "temperature": 0, "max_tokens": 48, "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "messages": [{"role": "user", "content": "Give me a person."}]})
    deltas = [c["choices"][0] for c in events[:-1]]
    args = "".join(d["delta"]["tool_calls"][0]["function"]["arguments"] for d in deltas if d["delta"].get("tool_calls"))
    assert args == call["function"]["arguments"] and deltas[-1]["finish_reason"] == "tool_calls"
    # A tool answer goes back in as a message of role tool.
    back = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    assert chat(tiny_app, messages=back, max_tokens=4)["choices"][0]["message"]["role"] == "assistant"


PICK = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
    "additionalProperties": False}}}


def test_several_tool_calls_whole_and_streamed(tiny_app):
    """parallel_tool_calls (true by default) lets a response make several calls: min_tokens holds EOS back past
    the first call, so the output goes on to more calls, each returned with its own id and streamed at its own index
    (accumulated by the openai SDK's stream helper to the same calls); with parallel_tool_calls false the same
    request makes exactly one (the control). Several answers go back as tool messages, one per call id."""
    import openai

    from serve_helpers import API_KEY

    fields = {"tools": [PICK], "tool_choice": {"type": "function", "function": {"name": "pick"}},
              "max_tokens": 64}
    one = chat(tiny_app, parallel_tool_calls=False, return_token_ids=True, **fields)["choices"][0]
    assert len(one["message"]["tool_calls"]) == 1
    held = {**fields, "min_tokens": len(one["token_ids"]) + 1}  # EOS is banned where the first call ends
    still_one = chat(tiny_app, parallel_tool_calls=False, **held)["choices"][0]
    assert len(still_one["message"]["tool_calls"]) == 1 and still_one["finish_reason"] == "tool_calls"
    many = chat(tiny_app, **held)["choices"][0]
    calls = many["message"]["tool_calls"]
    assert len(calls) >= 2 and len({c["id"] for c in calls}) == len(calls), calls
    assert many["finish_reason"] in ("tool_calls", "length") and many["message"]["content"] is None
    complete = calls if many["finish_reason"] == "tool_calls" else calls[:-1]
    for call in complete:
        assert call["function"]["name"] == "pick"
        jsonschema.validate(json.loads(call["function"]["arguments"]), PICK["function"]["parameters"])
    body = {"model": "tiny-a", "temperature": 0, "messages": [{"role": "user", "content": "Give me a person."}],
            **held}
    events = sse_events(f"{tiny_app.url}/v1/chat/completions", {**body, "stream": True})
    pieces = [p for e in events[:-1] for c in e["choices"] for p in c["delta"].get("tool_calls") or []]
    starts = [p for p in pieces if "id" in p]
    assert [p["index"] for p in starts] == list(range(len(calls)))
    assert [p["function"]["name"] for p in starts] == ["pick"] * len(calls)
    assert [p["index"] for p in pieces] == sorted(p["index"] for p in pieces)  # call i + 1 begins after call i
    client = openai.OpenAI(base_url=f"{tiny_app.url}/v1", api_key=API_KEY, timeout=120, max_retries=0)
    with client.chat.completions.stream(model="tiny-a", messages=body["messages"], tools=fields["tools"],
                                        tool_choice=fields["tool_choice"], max_tokens=64, temperature=0,
                                        extra_body={"min_tokens": held["min_tokens"]}) as stream:
        final = stream.get_final_completion().choices[0]
    got = [(c.function.name, c.function.arguments) for c in final.message.tool_calls]
    assert got == [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert final.finish_reason == many["finish_reason"] and len({c.id for c in final.message.tool_calls}) == len(got)
    back = [{"role": "user", "content": "Pick two."}, {"role": "assistant", "content": None, "tool_calls": calls[:2]},
            *({"role": "tool", "tool_call_id": c["id"], "content": str(i)} for i, c in enumerate(calls[:2]))]
    assert chat(tiny_app, messages=back, max_tokens=4)["choices"][0]["message"]["role"] == "assistant"


BAD = [  # (fields, param)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"logit_bias": {"99999": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 20, "max_tokens": 4}, "min_tokens"),
    ({"stop_token_ids": [99999]}, "stop_token_ids"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tools"),
    ({"guided_json": SCHEMA}, "guided_json"),
    ({"min_p": 0.1}, "min_p"),
    ({"no_such_field": 1}, "no_such_field"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[p for _, p in BAD])
def test_bad_fields_are_400_naming_the_field(tiny_app, fields, param):
    body = {"model": "tiny-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **fields}
    r = post(f"{tiny_app.url}/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_ignored_fields_are_accepted(tiny_app):
    fields = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
              "stream_options": {"include_usage": True}, "parallel_tool_calls": False}
    assert chat(tiny_app, max_tokens=4, **fields)["choices"][0]["message"]["content"] is not None
