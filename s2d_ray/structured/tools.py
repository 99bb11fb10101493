"""Tool calls by constrained decoding: the grammar of a call for a `tool_choice`, the system text that shows the
model its tools, and the parse of the output back into OpenAI's `tool_calls`.

The wire format is one call per response, `{"name": ..., "arguments": {...}}`; with `tool_choice: "auto"` the model
either answers in text or writes `<tool_call>` + that object + `</tool_call>` (the Hermes / Qwen convention), so text
that begins with `<tool_call>` is always a call. A named function's output is its arguments object alone.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from .grammars import JSON_OPTIONS, GrammarSpec, check_json_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: str  # the JSON schema of its arguments, as JSON (property order kept)
    description: str = ""

    @classmethod
    def of(cls, name: str, parameters: dict[str, Any] | None, description: str | None) -> "ToolSpec":
        schema = parameters if parameters is not None else EMPTY_PARAMETERS
        check_json_schema(schema, "tools")
        return cls(name, json.dumps(schema), description or "")

    @property
    def schema(self) -> dict[str, Any]:
        return json.loads(self.parameters)


def call_schema(tools: tuple[ToolSpec, ...]) -> dict[str, Any]:
    """One call object of any of the tools: its name and arguments valid for that name."""
    options = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.schema},
                "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def not_prefixed(prefix: str) -> str:
    """A regex of every text (empty included) that does not start with `prefix`."""
    alternatives = [""]
    for i, ch in enumerate(prefix):
        alternatives.append("".join(f"[{c}]" for c in prefix[:i]) + f"[^{ch}][\\s\\S]*")
    alternatives += ["".join(f"[{c}]" for c in prefix[:i]) for i in range(1, len(prefix))]
    return "(" + "|".join(alternatives) + ")"


def tool_grammar(tools: tuple[ToolSpec, ...], choice: str) -> GrammarSpec:
    """`choice`: "required", "auto", or a function's name (its arguments only)."""
    named = [t for t in tools if t.name == choice]
    if named:
        return GrammarSpec("json_schema", named[0].parameters, "tools")
    if choice == "required":
        return GrammarSpec.json_schema(call_schema(tools), "tools")
    call = json.dumps({**call_schema(tools), "x-guidance": JSON_OPTIONS})
    lark = (f'start: TEXT | "{OPEN}" call "{CLOSE}"\n'
            f"call: %json {call}\n"
            f"TEXT: /{not_prefixed(OPEN)}/\n")
    return GrammarSpec("grammar", lark, "tools")


def tool_instructions(choice: str) -> str:
    """How to answer under `choice` (the grammar enforces the format either way)."""
    if choice == "auto":
        return (f"To call a function, answer with {OPEN}{{\"name\": <function name>, \"arguments\": <arguments "
                f"object>}}{CLOSE}")
    if choice == "required":
        return "Answer with one call: {\"name\": <function name>, \"arguments\": <arguments object>}"
    return f"Answer with the arguments object of a call to {choice}."


def tool_prompt(tools: tuple[ToolSpec, ...], choice: str) -> str:
    """The system text that lists the tools and how to call one, for templates that do not render tools."""
    listing = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.schema})
                        for t in tools)
    return f"You can call these functions:\n{listing}\n{tool_instructions(choice)}"


def wire_call(name: str, arguments: str) -> str:
    """A call as the model writes it (`auto`'s wrapper), for an assistant message a client sends back."""
    return f'{OPEN}{{"name": {json.dumps(name)}, "arguments": {arguments}}}{CLOSE}'


def parse_tool_call(text: str, choice: str) -> tuple[str | None, list[dict] | None]:
    """(content, tool_calls) of an output: a named call's text is its arguments; `required` output is a call
    object; `auto` output is text unless it starts with the call wrapper. A call cut short (finish_reason length)
    keeps its partial arguments, as OpenAI's would."""
    if choice not in ("auto", "required"):
        return None, [_call(choice, text)]
    body = text
    if choice == "auto":
        if not text.startswith(OPEN):
            return text, None
        body = text[len(OPEN):].removesuffix(CLOSE)
    try:
        obj = json.loads(body)
        return None, [_call(obj["name"], json.dumps(obj["arguments"]))]
    except (ValueError, KeyError, TypeError):
        return (text, None) if choice == "auto" else (None, [_call("", body)])


def _call(name: str, arguments: str) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": arguments}}
