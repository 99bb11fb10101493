"""Response rendering: the engine's results (request_shapes.GenerateResponse / GenerateChunk) as OpenAI's JSON
bodies and stream chunks, choice by choice; a chat choice's tool calls through tool_deltas.py."""

from __future__ import annotations

import time
import uuid
from typing import Callable

from ..core.logprobs import TokenLogprob
from .request_shapes import GenerateChunk, GenerateResponse, Usage
from .tool_deltas import ToolCallDeltas

MIN_LOGPROB = -9999.0  # -inf (tokens past top-k / top-p) is not JSON; vLLM clamps to the same value


def error_body(message: str, code: str | None = None, param: str | None = None,
               type_: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ResponseIds:
    """Ids and timestamps of one OpenAI response (shared by all its stream chunks)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def head(self, model: str, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": model}


class ChoiceView:
    """One choice of an OpenAI response: its index, echo and logprobs in the API's shapes, across stream chunks.

    Completions: `{tokens, token_logprobs, top_logprobs, text_offset}`, the chosen token included in each
    top_logprobs dict (so up to n + 1 entries, as OpenAI documents); with echo the prompt's tokens come first, the
    first with null. Chat: `{content: [{token, logprob, bytes, top_logprobs: [...]}]}`. Token strings are the tokens
    decoded one by one; offsets count those strings from the start of the choice's text. Chat `bytes` are the
    token's own bytes (`token_bytes`, s2d_ray/token_bytes.py), right for byte-fallback and partial-character tokens.
    Under tools (`tool_mode`: the effective tool_choice) a chat choice's text becomes its tool calls (tool_deltas.py).
    """

    def __init__(self, ids: ResponseIds, index: int, token_text: Callable[[int], str], logprobs: bool,
                 echo_text: str | None = None, token_ids: bool = False, tool_mode: str | None = None,
                 token_bytes: Callable[[int], list[int]] | None = None) -> None:
        self.ids, self.index, self.token_text = ids, index, token_text
        self.token_bytes = token_bytes or (lambda t: list(token_text(t).encode("utf-8")))
        self.want_logprobs, self.echo_text, self.want_token_ids = logprobs, echo_text, token_ids
        self.offset = 0
        self.tool_mode = tool_mode
        self.tools = ToolCallDeltas(tool_mode) if tool_mode is not None else None  # its calls across chunks

    def choice(self, part: GenerateChunk | GenerateResponse, chunk: bool, first: bool) -> dict:
        text, lp = part.text, None
        if first and self.echo_text is not None:
            text = self.echo_text + text
        if self.want_logprobs:
            entries: list[TokenLogprob | None] = list(part.logprobs or [])
            tokens = list(part.token_ids)
            if first and self.echo_text is not None and part.prompt_logprobs is not None:
                entries, tokens = list(part.prompt_logprobs) + entries, list(part.prompt_token_ids or []) + tokens
            lp = self._chat_logprobs(entries) if self.ids.chat else self._completion_logprobs(tokens, entries)
        reason = part.finish_reason
        extra = {"token_ids": list(part.token_ids)} if self.want_token_ids else {}
        if not self.ids.chat:
            return {"index": self.index, "text": text, "finish_reason": reason, "logprobs": lp, **extra}
        if self.tool_mode is not None:
            return self._tool_choice(text, reason, chunk, first, {"logprobs": lp, **extra})
        if chunk:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            return {"index": self.index, "delta": delta, "finish_reason": reason, "logprobs": lp, **extra}
        return {"index": self.index, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                "logprobs": lp, **extra}

    def _tool_choice(self, text: str, reason: str | None, chunk: bool, first: bool, extra: dict) -> dict:
        """A chat choice under tools: `tool_calls` (finish_reason tool_calls), one or more, or, with auto, plain
        content. Streamed, each call comes as OpenAI streams it (tool_deltas.py)."""
        if chunk:
            delta = {"role": "assistant", "content": None} if first else {}
            delta.update(self.tools.delta(text, done=reason is not None))
            body: dict = {"delta": delta}
        else:
            body = {"message": self.tools.message(text)}
        if reason == "stop" and self.tools.called:
            reason = "tool_calls"
        return {"index": self.index, **body, "finish_reason": reason, **extra}

    def _completion_logprobs(self, tokens: list[int], entries: list[TokenLogprob | None]) -> dict:
        strs = [self.token_text(t) for t in tokens]
        offsets = []
        for s in strs:
            offsets.append(self.offset)
            self.offset += len(s)
        tops = [None if e is None else {**{self.token_text(i): _clamp(v) for i, v in e.top}, s: _clamp(e.logprob)}
                for s, e in zip(strs, entries)]
        return {"tokens": strs, "token_logprobs": [None if e is None else _clamp(e.logprob) for e in entries],
                "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, entries: list[TokenLogprob | None]) -> dict:
        def item(token: int, logprob: float) -> dict:
            s = self.token_text(token)
            return {"token": s, "logprob": _clamp(logprob), "bytes": self.token_bytes(token)}

        content = [{**item(e.token, e.logprob), "top_logprobs": [item(i, v) for i, v in e.top]}
                   for e in entries if e is not None]
        return {"content": content, "refusal": None}


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def full_response(ids: ResponseIds, model: str, views: list[ChoiceView], resps: list[GenerateResponse],
                  n: int) -> dict:
    """The non-streamed body; usage sums the choices (each prompt counted once, its n choices each)."""
    body = {**ids.head(model, chunk=False), "choices": [v.choice(r, False, True) for v, r in zip(views, resps)],
            "usage": total_usage(resps, n).model_dump()}
    metrics = [r.metrics for r in resps]
    body["metrics"] = {"speculative_decoding": metrics[0] if len(metrics) == 1 else metrics}
    return body


def total_usage(parts: list[GenerateResponse | GenerateChunk], n: int = 1) -> Usage:
    """Completion tokens of every choice; prompt tokens once per prompt (choices come n per prompt)."""
    usages = [p.usage for p in parts if p.usage is not None]
    prompt = sum(u.prompt_tokens for u in usages[::n])
    completion = sum(u.completion_tokens for u in usages)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def stream_chunk(ids: ResponseIds, model: str, view: ChoiceView, chunk: GenerateChunk, first: bool,
                 usage: bool = True) -> dict:
    """One SSE chunk of one choice; with `usage` (single-choice streams) the last chunk carries usage and metrics."""
    body = {**ids.head(model, chunk=True), "choices": [view.choice(chunk, True, first)]}
    if usage and chunk.usage is not None:
        body["usage"] = chunk.usage.model_dump()
        body["metrics"] = {"speculative_decoding": chunk.metrics}
    return body


def usage_chunk(ids: ResponseIds, model: str, usage: Usage, metrics: list[dict | None]) -> dict:
    """The closing chunk of a multi-choice stream: no choices, the summed usage and each choice's metrics."""
    return {**ids.head(model, chunk=True), "choices": [], "usage": usage.model_dump(),
            "metrics": {"speculative_decoding": metrics}}
