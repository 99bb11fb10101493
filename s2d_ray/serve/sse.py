"""An OpenAI streaming response as server-sent events: one chunk per round per choice, one usage chunk after several
choices, keep-alive comments while a queued stream waits for its first tokens, errors in-band once the status is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from .choices import merge
from .http_api import api_error
from .keepalive import keepalive
from .metrics import ServeMetrics
from .openai_protocol import (
    ChoiceView, GenerateChunk, ResponseIds, error_body, stream_chunk, total_usage, usage_chunk,
)


@dataclass(frozen=True)
class EventStream:
    """The SSE body of a router's streamed responses; errors counted in `metrics`, keep-alives every `keepalive_s`."""

    metrics: ServeMetrics
    keepalive_s: float

    async def queued(self, pending: asyncio.Future, ids: ResponseIds, model: str, views: list[ChoiceView],
                     streams: list[AsyncIterator[GenerateChunk]], n: int) -> AsyncIterator[str]:
        """keepalive.py: comment lines until the first tokens, then the stream; an error before them in-band."""
        async for line in keepalive(pending, self.keepalive_s):
            yield line
        try:
            firsts = pending.result()
        except Exception as exc:
            yield self.error_event(exc, model)
            yield "data: [DONE]\n\n"
            return
        async for part in self.stream(ids, model, views, firsts, streams, n):
            yield part

    async def stream(self, ids: ResponseIds, model: str, views: list[ChoiceView], firsts: list[GenerateChunk],
                     streams: list[AsyncIterator[GenerateChunk]], n: int) -> AsyncIterator[str]:
        """One chunk per round per choice; several choices end with one usage chunk. Closing this (the client
        hung up) closes every choice's stream, which aborts its sequence."""
        single, finals = len(streams) == 1, {}
        async with contextlib.aclosing(merge(firsts, streams)) as chunks:
            try:
                async for i, chunk, first in chunks:
                    if chunk.usage is not None:
                        finals[i] = chunk
                    yield f"data: {json.dumps(stream_chunk(ids, model, views[i], chunk, first, single))}\n\n"
                if not single:
                    parts = [finals[i] for i in sorted(finals)]
                    body = usage_chunk(ids, model, total_usage(parts, n), [p.metrics for p in parts])
                    yield f"data: {json.dumps(body)}\n\n"
            except Exception as exc:  # after the first byte the status is sent: report in-band, like OpenAI
                yield self.error_event(exc, model)
        yield "data: [DONE]\n\n"

    def error_event(self, exc: Exception, model: str) -> str:
        err = api_error(exc)
        self.metrics.errors.labels(model, str(err.status)).inc()
        return f"data: {json.dumps(error_body(err.message, err.code, err.param, err.type))}\n\n"
