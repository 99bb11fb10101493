"""Reading tool calls back out of a model's output, whole or as it grows (a stream).

Calls are written one per line (`SEPARATOR`): compact JSON holds no raw newline (one inside a string is escaped), so
a newline in the output is always a boundary between calls. Per tool_choice a line is:

- a named function: its arguments object;
- `required`: `{"name": N, "arguments": A}`;
- `auto`: `<tool_call>` + that object + `</tool_call>`; output that does not begin with `<tool_call>` is text.

`read_calls(text, choice, done=False)` on a prefix of the output returns what is certain so far: each call's name
once it is complete, and its arguments up to the characters that may still turn out to be the wrapper's end. So the
arguments (and text) read from a longer prefix always extend those of a shorter one: a stream sends the differences,
and what it sent adds up to the whole output's reading. A call's arguments are the output's own characters, not a
re-serialization (non-ASCII text stays as generated).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
SEPARATOR = "\n"
_HEAD = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')


@dataclass
class ReadCalls:
    """`content`: the text answer (None: no text, or not yet known); `calls`: (name, arguments) in order."""

    content: str | None = None
    calls: list[tuple[str, str]] = field(default_factory=list)


def read_calls(text: str, choice: str, done: bool = True) -> ReadCalls:
    """The calls (or text) in `text` under `choice` ("auto", "required" or a function's name); `done`: the output
    is complete (a call cut short by the length limit keeps its partial arguments, as OpenAI's would)."""
    if choice not in ("auto", "required"):
        lines = text.split(SEPARATOR)  # an empty last line: a separator whose call has not begun
        return ReadCalls(None, [(choice, a) for i, a in enumerate(lines) if i == 0 or a])
    wrapper = ("", "")
    if choice == "auto":
        if not text.startswith(OPEN):
            return ReadCalls(None if OPEN.startswith(text) and not done else text)
        wrapper = (OPEN, CLOSE)
    out = ReadCalls()
    lines = text.split(SEPARATOR)
    for i, line in enumerate(lines):
        final = done or i < len(lines) - 1
        call = _read_line(line, wrapper, final)
        if call is None:  # its name is not complete yet
            break
        if call[0] == "" and choice == "auto" and not out.calls:
            return ReadCalls(text)  # never a call: text (the grammar makes this unreachable when served)
        out.calls.append(call)
    return out


def _read_line(line: str, wrapper: tuple[str, str], final: bool) -> tuple[str, str] | None:
    """(name, arguments) of one line; None while its name is incomplete; a final line whose head is unreadable is
    read as a JSON object, else kept whole as the arguments of a call without a name."""
    start, end = wrapper
    head = _HEAD.match(line, len(start)) if line.startswith(start) else None
    if head is not None:
        name, rest = json.loads(head.group(1)), line[head.end():]
        tail = "}" + end  # the call object's closing brace and the wrapper's end follow the arguments
        if not final:
            return name, rest[:max(0, len(rest) - len(tail))]
        if rest.endswith(tail) and _is_json(rest[:-len(tail)]):
            return name, rest[:-len(tail)]
        return name, rest  # cut short
    if not final:
        return None
    body = line[len(start):] if line.startswith(start) else line
    body = body[:-len(end)] if end and body.endswith(end) else body
    try:
        obj = json.loads(body)
        return str(obj["name"]), json.dumps(obj["arguments"])
    except (ValueError, KeyError, TypeError):
        return "", body


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
