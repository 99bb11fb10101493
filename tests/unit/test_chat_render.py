"""Chat messages reach the prompt whole: `name` and `tool_call_id` go to a template that reads them and into the
text otherwise; tools go through a template that renders tools (its `tools` argument) and into a system message
otherwise. Controls: the same messages without those fields render differently."""

from __future__ import annotations

import pytest

from helpers import make_tiny_tokenizer
from s2d_ray.serve.chat_render import encode_chat, template_renders_tools
from s2d_ray.serve.openai_protocol import ChatMessage
from s2d_ray.structured import ToolSpec

# A template that reads name, tool_call_id and tools (the shape of Hermes / Qwen templates, cut down).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}"
    "{% if message.name %} ({{ message.name }}){% endif %}"
    "{% if message.tool_call_id %} [{{ message.tool_call_id }}]{% endif %}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

TOOLS = (ToolSpec.of("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}}, "Weather"),)


def messages(named: bool = True) -> list[ChatMessage]:
    extra = {"name": "ann"} if named else {}
    return [ChatMessage(role="user", content="Weather in Paris?", **extra),
            ChatMessage(role="tool", content="sunny", **({"tool_call_id": "call_1"} if named else {}))]


@pytest.fixture()
def chatml():
    return make_tiny_tokenizer(320)


@pytest.fixture()
def tool_aware():
    tok = make_tiny_tokenizer(320)
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def text(tok, msgs, tools=None, mode=None, parallel=True) -> str:
    return tok.decode(encode_chat(tok, msgs, tools, mode, parallel))


def test_a_template_that_reads_the_fields_gets_them(tool_aware):
    out = text(tool_aware, messages())
    assert "user (ann)" in out and "tool [call_1]" in out and "ann:" not in out and "<tool_response>" not in out
    assert out != text(tool_aware, messages(named=False))


def test_a_template_that_does_not_gets_them_in_the_text(chatml):
    out = text(chatml, messages())
    assert "ann: Weather in Paris?" in out
    assert '<tool_response>{"tool_call_id": "call_1"}\nsunny</tool_response>' in out
    assert "ann" not in text(chatml, messages(named=False)) and "call_1" not in text(chatml, messages(named=False))


def test_tools_through_the_template_when_it_renders_them(tool_aware, chatml):
    assert template_renders_tools(tool_aware) and not template_renders_tools(chatml)
    out = text(tool_aware, messages(), TOOLS, "auto")
    assert "TOOLS: get_weather" in out and "You can call these functions" not in out
    named = text(tool_aware, messages(), TOOLS, "get_weather")  # the grammar's form is still said
    assert "Answer with the arguments object of a call to get_weather." in named
    fallback = text(chatml, messages(), TOOLS, "auto")
    assert "You can call these functions" in fallback and '"name": "get_weather"' in fallback
    assert text(tool_aware, messages(), None, None) == text(tool_aware, messages())  # control: no tools, none shown


def test_several_calls_and_their_answers_render_back(tool_aware, chatml):
    """An assistant message with two calls renders them one per line (the form the grammar writes), and each tool
    answer carries its own call id: through the template that reads `tool_call_id`, and in the text otherwise.
    Control: the answers' ids swapped render differently."""
    calls = [{"id": "call_a", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_b", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]

    def chat(first: str, second: str) -> list[ChatMessage]:
        return [ChatMessage(role="user", content="Weather in Paris and Oslo?"),
                ChatMessage(role="assistant", content=None, tool_calls=calls),
                ChatMessage(role="tool", content="sunny", tool_call_id=first),
                ChatMessage(role="tool", content="rainy", tool_call_id=second)]

    wire = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    out = text(tool_aware, chat("call_a", "call_b"), TOOLS, "auto")
    assert wire in out and "tool [call_a]sunny" in out and "tool [call_b]rainy" in out  # trim_blocks drops the newline
    fallback = text(chatml, chat("call_a", "call_b"), TOOLS, "auto")
    assert wire in fallback and "several calls" in fallback
    assert '{"tool_call_id": "call_a"}\nsunny' in fallback and '{"tool_call_id": "call_b"}\nrainy' in fallback
    assert text(tool_aware, chat("call_b", "call_a"), TOOLS, "auto") != out


def test_the_form_asked_for_follows_parallel_tool_calls(chatml):
    several = text(chatml, messages(), TOOLS, "required", True)
    one = text(chatml, messages(), TOOLS, "required", False)
    assert "one or more calls" in several and "one per line" in several
    assert "one call:" in one and "one per line" not in one
