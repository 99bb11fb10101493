"""Request preparation off the router's event loop.

Chat templates, tokenization and grammar compiles take milliseconds to seconds of CPU per request; on the event loop
they would stall every stream the router replica serves (each round's events, each SSE write). They run on one
worker thread instead: the loop keeps delivering rounds while a request is prepared. One worker, not several:
a Hugging Face fast tokenizer is not safe to call from two threads at once ("Already borrowed"), and on the small
hosts this targets a second worker would only compete with the loop for the same cores.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")


class Preparer:
    """Runs preparation functions on one dedicated thread, awaited from the event loop."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="s2d-prepare")

    async def run(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
