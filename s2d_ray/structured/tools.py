"""Tool calls by constrained decoding: the grammar of the calls for a `tool_choice`, the system text that shows the
model its tools, and the parse of the output back into OpenAI's `tool_calls`.

A call is written `{"name": ..., "arguments": {...}}`; with `tool_choice: "auto"` the model either answers in text or
writes `<tool_call>` + that object + `</tool_call>` (the Hermes / Qwen convention), so text that begins with
`<tool_call>` is always a call. A named function's output is its arguments object alone. With parallel calls
allowed (OpenAI's `parallel_tool_calls`, on by default) the grammar allows one or more calls, one per line
(tool_calls.py reads them back); without, exactly one.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from .grammars import JSON_OPTIONS, GrammarSpec, check_json_schema
from .tool_calls import CLOSE, OPEN, SEPARATOR, read_calls
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


def tool_grammar(tools: tuple[ToolSpec, ...], choice: str, parallel: bool = True) -> GrammarSpec:
    """`choice`: "required", "auto", or a function's name (its arguments only); `parallel`: one or more calls, one
    per line, instead of exactly one."""
    named = [t for t in tools if t.name == choice]
    if not parallel and named:
        return GrammarSpec("json_schema", named[0].parameters, "tools")
    if not parallel and choice == "required":
        return GrammarSpec.json_schema(call_schema(tools), "tools")
    schema = named[0].schema if named else call_schema(tools)
    call = json.dumps({**schema, "x-guidance": JSON_OPTIONS})
    sep = json.dumps(SEPARATOR)
    if named or choice == "required":
        return GrammarSpec("grammar", f"start: call ({sep} call)*\ncall: %json {call}\n", "tools")
    wrapped = f'"{OPEN}" call "{CLOSE}"'
    calls = f"({sep} {wrapped})*" if parallel else ""
    lark = (f"start: TEXT | {wrapped} {calls}\n"
            f"call: %json {call}\n"
            f"TEXT: /{not_prefixed(OPEN)}/\n")
    return GrammarSpec("grammar", lark, "tools")


def tool_instructions(choice: str, parallel: bool = True) -> str:
    """How to answer under `choice` (the grammar enforces the format either way)."""
    call = '{"name": <function name>, "arguments": <arguments object>}'
    several = " To make several calls, write one per line." if parallel else ""
    if choice == "auto":
        return f"To call a function, answer with {OPEN}{call}{CLOSE}{several}"
    if choice == "required":
        return f"Answer with {'one or more calls' if parallel else 'one call'}: {call}{several}"
    return f"Answer with the arguments object of a call to {choice}.{several}"


def tool_prompt(tools: tuple[ToolSpec, ...], choice: str, parallel: bool = True) -> str:
    """The system text that lists the tools and how to call one, for templates that do not render tools."""
    listing = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.schema})
                        for t in tools)
    return f"You can call these functions:\n{listing}\n{tool_instructions(choice, parallel)}"


def wire_call(name: str, arguments: str) -> str:
    """A call as the model writes it (`auto`'s wrapper), for an assistant message a client sends back."""
    return f'{OPEN}{{"name": {json.dumps(name)}, "arguments": {arguments}}}{CLOSE}'


def wire_calls(calls: list[tuple[str, str]]) -> str:
    """Several calls as the model writes them: one per line."""
    return SEPARATOR.join(wire_call(name, arguments) for name, arguments in calls)


def parse_tool_call(text: str, choice: str) -> tuple[str | None, list[dict] | None]:
    """(content, tool_calls) of a whole output, each call with its own id: a named call's text is its arguments (one
    per line); `required` output is call objects (one per line); `auto` output is text unless it starts with the
    call wrapper. A call cut short (finish_reason length) keeps its partial arguments, as OpenAI's would."""
    read = read_calls(text, choice, done=True)
    return read.content, [_call(name, arguments) for name, arguments in read.calls] or None


def _call(name: str, arguments: str) -> dict:
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]
