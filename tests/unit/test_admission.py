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
def test_a_heavy_preparation_makes_the_worker_rest(share, heavy, rests):
    cost = 0.08 if heavy else HEAVY_S / 5

    async def main():
        preparer = Preparer(share)
        await preparer.run(_busy, cost)
        done = time.monotonic()
        nxt = await preparer.run(time.monotonic)
        return nxt - done

    gap = asyncio.run(main())
    if rests:
        assert gap >= cost * (1 / share - 1) * 0.9
    else:
        assert gap < 0.05


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
