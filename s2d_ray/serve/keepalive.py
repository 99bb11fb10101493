"""Streams that wait (queued for a decode slot, a long prefill) keep their connection alive with SSE comments.

A stream's HTTP status waits for its first tokens, so that admission errors (400, 404, 429) still get their status.
Those come before the request is queued; past `first_wait_s` without tokens the request is admitted and waiting, so
the response starts (200) and sends `: keep-alive` comment lines (ignored by SSE clients) every `interval_s` until its
first tokens, and proxies and clients with idle timeouts do not drop it. An error after that is reported in-band, as
one later in the stream is.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

KEEPALIVE_LINE = ": keep-alive\n\n"


async def settled_within(pending: asyncio.Future, seconds: float) -> bool:
    """Whether `pending` is done within `seconds` (it keeps running either way; cancelled if the caller is)."""
    try:
        done, _ = await asyncio.wait({pending}, timeout=seconds)
    except BaseException:
        pending.cancel()
        raise
    return bool(done)


async def keepalive(pending: asyncio.Future, interval_s: float) -> AsyncIterator[str]:
    """Comment lines every `interval_s` until `pending` is done (cancelled when the client goes away)."""
    try:
        while not pending.done():
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield KEEPALIVE_LINE
    finally:
        if not pending.done():
            pending.cancel()
