"""Request preparation off the event loop (serve/admission.py): the loop keeps running while a request is prepared,
and a heavy preparation makes the worker rest in proportion to `share`, a light one does not."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from s2d_ray.serve.admission import HEAVY_S, PREPARE_SWITCH_INTERVAL_S, Preparer


def _busy(seconds: float) -> float:
    """Pure Python work (holds the GIL) for about `seconds`; returns when it started."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        sum(range(200))
    return start


def test_the_loop_keeps_ticking_while_a_request_is_prepared():
    async def main():
        preparer = Preparer()
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1

        task = asyncio.create_task(ticker())
        await preparer.run(_busy, 0.3)
        task.cancel()
        return ticks

    assert asyncio.run(main()) >= 10  # on the loop, the same work would have allowed none
    assert sys.getswitchinterval() <= PREPARE_SWITCH_INTERVAL_S


@pytest.mark.parametrize("share, heavy, rests", [(0.25, True, True), (0.25, False, False), (1.0, True, False)])
def test_a_heavy_preparation_delays_the_next_heavy_one(share, heavy, rests):
    cost = 0.08 if heavy else HEAVY_S / 5

    async def main():
        preparer = Preparer(share)
        await preparer.run(_busy, cost)
        done = time.monotonic()
        light = await preparer.run(time.monotonic, heavy=False)  # never waits for a rest
        nxt = await preparer.run(time.monotonic)
        return light - done, nxt - done

    light, gap = asyncio.run(main())
    assert light < 0.05
    if rests:
        assert gap >= cost * (1 / share - 1) * 0.9
    else:
        assert gap < 0.05


def test_light_preparations_run_while_a_heavy_one_waits_for_its_rest():
    async def main():
        preparer = Preparer(0.1)
        await preparer.run(_busy, 0.05)  # the next heavy one starts 0.45 s later
        start = time.monotonic()
        heavy = asyncio.create_task(preparer.run(time.monotonic))
        await asyncio.sleep(0.01)
        light = await preparer.run(time.monotonic, heavy=False)
        return light - start, await heavy - start

    light, heavy = asyncio.run(main())
    assert light < 0.1 < 0.3 < heavy


def test_errors_pass_through_and_still_count():
    async def main():
        preparer = Preparer(0.5)

        def fail():
            _busy(0.05)
            raise ValueError("bad request")

        with pytest.raises(ValueError, match="bad request"):
            await preparer.run(fail)
        done = time.monotonic()
        return await preparer.run(time.monotonic) - done

    assert asyncio.run(main()) >= 0.04


def test_a_group_is_prepared_in_one_call_after_every_choice_started():
    """The choices' results arrive in one turn of the loop; a choice that fails before its first await (a 429)
    cancels the group's work before it starts."""
    import threading

    from s2d_ray.serve.admission import PreparedGroup

    calls: list[tuple[int, str]] = []

    def prep(i: int) -> int:
        calls.append((i, threading.current_thread().name))
        return i * 10

    async def main(fail_at: int | None):
        group = PreparedGroup(Preparer(), prep, [(i,) for i in range(3)])
        arrived: list[tuple[int, int]] = []
        turn = 0

        async def choice(i: int) -> None:
            if i == fail_at:
                raise RuntimeError("at capacity")
            arrived.append((i, await group.get(i), turn))

        async def clock():
            nonlocal turn
            while True:
                await asyncio.sleep(0)
                turn += 1

        ticker = asyncio.create_task(clock())
        try:
            async with asyncio.TaskGroup() as tasks:
                for i in range(3):
                    tasks.create_task(choice(i))
        finally:
            ticker.cancel()
        return arrived

    arrived = asyncio.run(main(None))
    assert sorted(a[:2] for a in arrived) == [(0, 0), (1, 10), (2, 20)]
    assert len({a[2] for a in arrived}) == 1  # all in the same turn of the loop
    assert sorted(i for i, _ in calls) == [0, 1, 2] and all(t.startswith("s2d-prepare") for _, t in calls)
    calls.clear()
    with pytest.raises(BaseExceptionGroup):
        asyncio.run(main(2))
    time.sleep(0.1)
    assert calls == []  # nothing was prepared for the refused request
