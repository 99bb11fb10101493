"""Several choices of one OpenAI request (n > 1, a batch of prompts) run as independent sequences, merged here.

Every per-choice stream is an async generator whose `finally` aborts its sequence (freeing KV); these functions make
sure every one of them is closed on every path: an error in one choice, or the client hanging up mid-stream.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, TypeVar

T = TypeVar("T")


async def gather_all(awaitables: list[Awaitable[T]]) -> list[T]:
    """All results in order; the first failure cancels the rest and is raised as itself (not an ExceptionGroup)."""
    async def run(a: Awaitable[T]) -> T:
        return await a

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(run(a)) for a in awaitables]
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from None
    return [t.result() for t in tasks]


async def first_items(streams: list[AsyncIterator[T]]) -> list[T]:
    """The first item of every stream (admission errors surface here, before any HTTP status is sent)."""
    try:
        return await gather_all([anext(s) for s in streams])
    except BaseException:
        await close_all(streams)
        raise


async def close_all(streams: list[AsyncIterator[T]]) -> None:
    for s in streams:
        await s.aclose()  # type: ignore[attr-defined]


async def merge(firsts: list[T], streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T, bool]]:
    """(choice index, item, is_first) as items arrive from any stream; the first error ends the whole merge."""
    for i, item in enumerate(firsts):
        yield i, item, True
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item, None))
            queue.put_nowait((i, None, None))
        except Exception as exc:
            queue.put_nowait((i, None, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is None:
                remaining -= 1
                continue
            yield i, item, False
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_all(streams)
