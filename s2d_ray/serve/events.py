"""What the scheduler hands each request after a round (`Event`), and the stream interval that merges them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import AsyncIterator


@dataclass
class Event:
    """What one round did for one request (or the error that ended it)."""

    tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None
    metrics: dict | None = None
    error: Exception | None = None
    logprobs: list | None = None  # core.logprobs.TokenLogprob per token, when the request asked
    prompt_logprobs: list | None = None  # first round only, when the request asked

    def then(self, later: "Event") -> "Event":
        """This event and the next as one: tokens and logprobs joined; the end, metrics and error are the later's."""
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            [*(self.logprobs or []), *(later.logprobs or [])]
        prompt = self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs
        return Event([*self.tokens, *later.tokens], later.finished, later.finish_reason, later.metrics, later.error,
                     logprobs, prompt)


async def coalesced(events: AsyncIterator[Event], min_tokens: int) -> AsyncIterator[Event]:
    """A request's events merged until they hold `min_tokens` tokens (vLLM's and SGLang's stream interval): fewer
    chunks for the router, the proxy and the client to carry, at a coarser inter-token latency. The first tokens
    (TTFT) and the last event are never held (an error is raised by the request's own events, ending the stream at
    once). Closing this closes `events` (which aborts the sequence)."""
    held, started = None, False
    async with contextlib.aclosing(events) as source:
        async for ev in source:
            ev, held = (held.then(ev) if held is not None else ev), None
            if ev.finished or len(ev.tokens) >= min_tokens or (
                    not started and (ev.tokens or ev.prompt_logprobs is not None)):
                started = True
                yield ev
            else:
                held = ev
