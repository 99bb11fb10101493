"""One chat choice's tool calls in OpenAI's shapes: the whole `message.tool_calls`, or the `delta.tool_calls` pieces
of a stream.

A stream sends each call as OpenAI does: its first piece carries `index`, `id`, `type` and the function's `name`
(with the arguments written so far), later pieces `index` and more `arguments`; the call at index i + 1 begins once
call i is complete. Text (tool_choice auto, no call) streams as `content`. Every chunk re-reads the output so far
(structured/tool_calls.py `read_calls`, whose readings only grow) and sends what the last chunk had not, so the pieces
add up to the non-streamed message, ids included.
"""

from __future__ import annotations

from ..structured.tool_calls import read_calls
from ..structured.tools import new_call_id


class ToolCallDeltas:
    """`mode`: the effective tool_choice ("auto", "required" or a function's name)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.text = ""
        self.ids: list[str] = []  # one per call seen so far, in index order
        self.sent: list[int] = []  # characters of each call's arguments sent
        self.content_sent = 0

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def _id(self, index: int) -> str:
        while len(self.ids) <= index:
            self.ids.append(new_call_id())
        return self.ids[index]

    def message(self, text: str) -> dict:
        """The non-streamed message of the whole output `text`."""
        read = read_calls(text, self.mode, done=True)
        message: dict = {"role": "assistant", "content": read.content}
        if read.calls:
            message["tool_calls"] = [{"id": self._id(i), "type": "function",
                                      "function": {"name": name, "arguments": arguments}}
                                     for i, (name, arguments) in enumerate(read.calls)]
        return message

    def delta(self, text: str, done: bool) -> dict:
        """The delta for `text`, the output's next piece (`done`: it is the last)."""
        self.text += text
        read = read_calls(self.text, self.mode, done)
        out: dict = {}
        if read.content is not None and len(read.content) > self.content_sent:
            out["content"] = read.content[self.content_sent:]
            self.content_sent = len(read.content)
        calls = []
        for i, (name, arguments) in enumerate(read.calls):
            if i == len(self.sent):
                calls.append({"index": i, "id": self._id(i), "type": "function",
                              "function": {"name": name, "arguments": arguments}})
                self.sent.append(len(arguments))
            elif len(arguments) > self.sent[i]:
                calls.append({"index": i, "function": {"arguments": arguments[self.sent[i]:]}})
                self.sent[i] = len(arguments)
        if calls:
            out["tool_calls"] = calls
        return out
