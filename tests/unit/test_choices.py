"""Merging the streams of several choices: every stream is closed (its sequence aborted) on every path."""

from __future__ import annotations

import asyncio

import pytest

from s2d_ray.serve.choices import first_items, gather_all, merge


class Streams:
    """Async generators that record whether their `finally` ran (what aborts a sequence in the router)."""

    def __init__(self) -> None:
        self.closed: set[int] = set()

    async def make(self, i: int, n: int, fail_at: int | None = None, delay: float = 0.0):
        try:
            for j in range(n):
                if j == fail_at:
                    raise ValueError(f"stream {i} failed")
                await asyncio.sleep(delay)
                yield (i, j)
        finally:
            self.closed.add(i)


def test_merge_yields_every_item_then_closes_all():
    async def go():
        s = Streams()
        streams = [s.make(i, 3, delay=0.001 * i) for i in range(3)]
        firsts = await first_items(streams)
        got = [(i, item) async for i, item, _ in merge(firsts, streams)]
        return s, got

    s, got = asyncio.run(go())
    assert sorted(item for _, item in got) == [(i, j) for i in range(3) for j in range(3)]
    assert all(i == item[0] for i, item in got)
    assert s.closed == {0, 1, 2}


def test_closing_the_merge_early_closes_every_stream():
    """The client hung up after one chunk: all n sequences must be aborted, including ones never read again."""
    async def go():
        s = Streams()
        streams = [s.make(i, 100, delay=0.01) for i in range(4)]
        firsts = await first_items(streams)
        merged = merge(firsts, streams)
        await anext(merged)
        await merged.aclose()
        return s

    assert asyncio.run(go()).closed == {0, 1, 2, 3}


def test_an_error_in_one_stream_ends_the_merge_and_closes_the_others():
    async def go():
        s = Streams()
        streams = [s.make(0, 100, delay=0.01), s.make(1, 100, fail_at=2)]
        firsts = await first_items(streams)
        with pytest.raises(ValueError, match="stream 1 failed"):
            async for _ in merge(firsts, streams):
                pass
        return s

    assert asyncio.run(go()).closed == {0, 1}


def test_admission_error_closes_the_admitted_streams():
    async def go():
        s = Streams()
        streams = [s.make(0, 5, delay=0.01), s.make(1, 5, fail_at=0)]
        with pytest.raises(ValueError, match="stream 1 failed"):
            await first_items(streams)
        return s

    assert asyncio.run(go()).closed == {0, 1}


def test_gather_all_raises_the_first_error_itself_and_cancels_the_rest():
    cancelled = []

    async def slow():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def bad():
        raise KeyError("boom")

    with pytest.raises(KeyError):
        asyncio.run(gather_all([slow(), bad()]))
    assert cancelled == [True]
    assert asyncio.run(gather_all([asyncio.sleep(0, result=1), asyncio.sleep(0, result=2)])) == [1, 2]


def test_a_huge_n_is_refused_before_any_choice_is_built():
    """n is a client's number and may be huge: the count is checked before fan-out builds a request per choice."""
    import pytest

    from s2d_ray.errors import RequestError
    from s2d_ray.serve.openai_protocol import ChatCompletionRequest, CompletionRequest

    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], n=2643647388697128079458304000)
    with pytest.raises(RequestError, match="choices requested"):
        chat.to_generate(max_choices=16)
    batch = CompletionRequest(model="m", prompt=["a", "b", "c"], n=6)
    with pytest.raises(RequestError, match="18 choices"):
        batch.to_generate(max_choices=16)
    assert len(CompletionRequest(model="m", prompt=["a", "b"], n=8).to_generate(max_choices=16)) == 16
