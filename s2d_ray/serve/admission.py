"""Request preparation off the router's event loop, at a bounded share of a core.

Chat templates, tokenization and grammar compiles take milliseconds to seconds of CPU per request; on the event loop
they would stall every stream the router replica serves (each round's events, each SSE write). They run on one
worker thread instead. One worker, not several: a Hugging Face fast tokenizer is not safe to call from two threads
at once ("Already borrowed"), and on the small hosts this targets a second worker would only compete with the loop
for the same cores.

A thread alone does not isolate the streams: much of the work holds the GIL (pure Python such as JSON-schema checks
and templates, and native calls such as a grammar compile), and each time the loop wakes it must take the GIL back.
Two measures bound what one client's heavy requests cost the others:
- a short switch interval (PREPARE_SWITCH_INTERVAL_S) in the router process, so the loop gets the GIL back within a
  fraction of a millisecond rather than CPython's default 5 ms;
- a duty cycle (`limits.prepare_share`) for heavy requests (a schema, tools, bad words, a long prompt:
  request_limits.heavy_request): after a preparation that took t seconds (past `HEAVY_S`) the next heavy one starts
  t x (1 / share - 1) later. A client sending requests at every bound slows its own admissions (and other heavy
  ones), not the rounds of the streams in flight; light requests are prepared at once, rest or not.
"""

from __future__ import annotations

import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

PREPARE_SWITCH_INTERVAL_S = 0.0005
HEAVY_S = 0.005  # a preparation shorter than this (a plain prompt) is not followed by a rest


class Preparer:
    """Runs preparation functions on one dedicated thread, awaited from the event loop; heavy ones (`heavy=True`)
    one at a time, using at most `share` of a core over time, light ones at once (they never wait for a rest)."""

    def __init__(self, share: float = 1.0) -> None:
        sys.setswitchinterval(min(sys.getswitchinterval(), PREPARE_SWITCH_INTERVAL_S))  # this process's, see above
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="s2d-prepare")
        self.share = share
        self._heavy = asyncio.Lock()
        self._ready_at = 0.0  # monotonic time before which no heavy preparation starts (written on the worker)

    async def run(self, fn: Callable[..., T], *args, heavy: bool = True) -> T:
        loop = asyncio.get_running_loop()
        if not heavy:
            return await loop.run_in_executor(self._pool, self._paced, fn, args, False)
        async with self._heavy:  # the rest is awaited here, so light preparations use the worker meanwhile
            wait = self._ready_at - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            return await loop.run_in_executor(self._pool, self._paced, fn, args, True)

    def _paced(self, fn: Callable[..., T], args: tuple, heavy: bool) -> T:
        """On the worker: fn, and the rest its cost asks for before the next heavy one (errors included). The rest
        is also kept here in case the loop's wait was skipped (a cancelled caller releases the lock early)."""
        wait = self._ready_at - time.monotonic()
        if heavy and wait > 0:
            time.sleep(wait)
        start = time.monotonic()
        try:
            return fn(*args)
        finally:
            spent = time.monotonic() - start
            if spent > HEAVY_S:  # a light one that was not, too
                self._ready_at = max(self._ready_at, time.monotonic() + spent * (1.0 / self.share - 1.0))


class PreparedGroup:
    """The choices of one request, prepared in one call on the worker (`get(i)`: choice i's result).

    All choices then reach the scheduler in the same turn of the loop and share their first round, as they did when
    they were prepared inline; prepared one by one, the first could start a round alone and the choices' float
    results (logprobs) would depend on that timing. The work starts once every choice has reserved its place and
    asked (`get`): a request refused for capacity prepares nothing (its other choices are cancelled waiting).
    """

    def __init__(self, preparer: Preparer, fn: Callable[..., T], calls: list[tuple], heavy: bool = True) -> None:
        self._preparer, self._fn, self._calls, self._heavy = preparer, fn, calls, heavy
        self._arrived = 0
        self._started = asyncio.Event()
        self._task: asyncio.Future | None = None

    async def get(self, index: int) -> T:
        """Choice `index`'s result; every choice must call this (the work starts when the last one does)."""
        self._arrived += 1
        if self._arrived == len(self._calls):
            self._task = asyncio.ensure_future(self._preparer.run(self._all, heavy=self._heavy))
            self._task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved if nobody waits
            self._started.set()
        await self._started.wait()
        return (await asyncio.shield(self._task))[index]

    def _all(self) -> list:
        return [self._fn(*args) for args in self._calls]
