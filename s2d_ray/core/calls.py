"""Work written once as a generator of calls, run by a synchronous or an asynchronous driver.

A round talks to its drafter and verifier through calls whose answers are values (in-process objects) or awaitables
(deployment clients). Written as a generator, the round yields each call's answer as the call returned it and is sent
back the value: `drive` sends answers straight back, `drive_async` awaits the awaitable ones first. Both drivers run
every step of the same code, so the synchronous and asynchronous rounds cannot drift apart.
"""

from __future__ import annotations

import inspect
from typing import Any, Generator, TypeVar

T = TypeVar("T")

# Yields call answers (values or awaitables), is sent the values, returns T.
Calls = Generator[Any, Any, T]


def drive(calls: Calls[T]) -> T:
    """Run `calls` with every answer sent back as it is (the calls must answer values)."""
    try:
        answer = next(calls)
        while True:
            answer = calls.send(answer)
    except StopIteration as done:
        return done.value


async def drive_async(calls: Calls[T]) -> T:
    """Run `calls`, awaiting each answer that is an awaitable before sending its value back."""
    try:
        answer = next(calls)
        while True:
            answer = calls.send(await answer if inspect.isawaitable(answer) else answer)
    except StopIteration as done:
        return done.value
