"""A choice's tool calls streamed in OpenAI's shapes: fed in pieces of every size, the chunks accumulate (by the
openai SDK's own stream state, the one `client.chat.completions.stream` uses) to the non-streamed message: the
same calls, names and arguments, each call at its own index with its own id, the name in its first piece. Control:
pieces that do not hold back the wrapper's end put it into the arguments."""

from __future__ import annotations

import time

import pytest

from s2d_ray.serve.tool_deltas import ToolCallDeltas
from s2d_ray.structured import tool_calls

CALLS = [("get_weather", '{"city": "Zürich"}'), ("add", '{"a": 2, "b": [1, 2]}')]
OUTPUTS = {
    "auto": "\n".join(f'<tool_call>{{"name": "{n}", "arguments": {a}}}</tool_call>' for n, a in CALLS),
    "required": "\n".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in CALLS),
    "get_weather": '{"city": "Zürich"}\n{"city": "Oslo"}',
}


def stream(mode: str, text: str, size: int) -> list[dict]:
    """The chat.completion.chunk bodies of `text` sent `size` characters at a time."""
    view, pieces = ToolCallDeltas(mode), [text[i:i + size] for i in range(0, len(text), size)] or [""]
    out = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = {"role": "assistant", "content": None} if i == 0 else {}
        delta.update(view.delta(piece, done=last))
        reason = ("tool_calls" if view.called else "stop") if last else None
        out.append({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]})
    return out


def accumulate(chunks: list[dict]):
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return state.get_final_completion().choices[0]


@pytest.mark.parametrize("mode", list(OUTPUTS))
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_calls_add_up_to_the_message(mode, size):
    text = OUTPUTS[mode]
    whole = ToolCallDeltas(mode).message(text)
    assert whole["content"] is None and len(whole["tool_calls"]) == 2
    assert len({c["id"] for c in whole["tool_calls"]}) == 2
    chunks = stream(mode, text, size)
    pieces = [c for ch in chunks for c in ch["choices"][0]["delta"].get("tool_calls", [])]
    firsts = {}
    for piece in pieces:
        if piece["index"] not in firsts:
            firsts[piece["index"]] = piece
            assert piece["id"].startswith("call_") and piece["function"]["name"]
        else:
            assert "id" not in piece and "name" not in piece["function"]
    assert sorted(firsts) == [0, 1] and [p["index"] for p in pieces] == sorted(p["index"] for p in pieces)
    final = accumulate(chunks)
    got = [(c.function.name, c.function.arguments) for c in final.message.tool_calls]
    assert got == [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
    assert final.finish_reason == "tool_calls" and len({c.id for c in final.message.tool_calls}) == 2


def test_text_under_auto_streams_as_content():
    """Held back while it could still begin a call (`<tool`), then streamed."""
    chunks = stream("auto", "<toolbox> <tool_call> text.", 2)
    final = accumulate(chunks)
    assert final.message.content == "<toolbox> <tool_call> text." and not final.message.tool_calls
    assert [c["choices"][0]["delta"].get("content") for c in chunks[:4]] == [None, None, "<toolb", "ox"]


def test_negative_control_arguments_without_holding_back_the_wrapper(monkeypatch):
    careless = tool_calls.read_calls
    monkeypatch.setattr("s2d_ray.serve.tool_deltas.read_calls", lambda text, mode, done: careless(text, mode, True))
    final = accumulate(stream("auto", OUTPUTS["auto"], 3))
    assert [c.function.arguments for c in final.message.tool_calls] != [a for _, a in CALLS]
