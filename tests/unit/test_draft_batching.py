"""The draft's batching window and capacity stats: a batch waits only for another caller's round predicted within a
share of one forward (fake clocks), the queue that applies it (real asyncio), busy fraction and queueing delay."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from s2d_ray.serve.draft_batching import MIN_SLACK_S, DraftCapacity, MergeQueue
from s2d_ray.serve.metrics import ServeMetrics


def learned(cap: DraftCapacity, away: dict[str, float], answered: float, rounds: int = 3) -> None:
    """The streams of `away` were answered together each round and came back that many seconds later, steadily;
    last answered together at `answered`."""
    t = answered - rounds * max(away.values())
    for _ in range(rounds):
        cap.answered(list(away), t)
        for stream, a in away.items():
            cap.arrive(stream, t + a)
        t += max(away.values())
    cap.answered(list(away), answered)


def twenty_ms_forwards(max_wait_s: float = 0.05, wait_fraction: float = 1.0) -> DraftCapacity:
    cap = DraftCapacity(max_wait_s=max_wait_s, wait_fraction=wait_fraction)
    cap.forward([0.0], {"a"}, 4, 0.0, 0.02)
    return cap


def test_one_stream_never_waits():
    cap = twenty_ms_forwards()
    learned(cap, {"a": 0.03}, 1.0)
    cap.arrive("a", 1.03)
    assert cap.hold_until({"a"}, 1.03, 1.03) is None  # busy round after round, but no one else to wait for


def test_a_stream_that_left_together_is_awaited_within_one_forward():
    cap = twenty_ms_forwards()
    learned(cap, {"a": 0.04, "b": 0.05}, 1.0)  # a and b left together; b stays away 10 ms longer every round
    assert cap.streams["b"].jitter_s == pytest.approx(0.0, abs=1e-12) and cap.streams["b"].due() == pytest.approx(1.05)
    cap.arrive("a", 1.04)
    # b is due in 10 ms, less than one 20 ms forward: hold until b's call plus the minimal slack
    assert cap.hold_until({"a"}, 1.04, 1.04) == pytest.approx(1.05 + MIN_SLACK_S)
    assert cap.hold_until({"a"}, 1.04, 1.0515) is None  # b is late past its slack: stop waiting
    assert cap.hold_until({"a", "b"}, 1.04, 1.045) is None  # b arrived: nothing else to wait for
    slow = twenty_ms_forwards()
    learned(slow, {"a": 0.04, "b": 0.07}, 1.0)
    slow.arrive("a", 1.04)
    assert slow.hold_until({"a"}, 1.04, 1.04) is None  # 30 ms every round is more than merging saves: run now
    assert cap.hold_until({"a"}, 1.5, 1.5) is None  # b went quiet long ago


def test_a_stream_out_of_phase_is_awaited_up_to_the_cap_once():
    """b did not leave with a: a wait up to the cap aligns the two, after which they leave together."""
    cap = twenty_ms_forwards(max_wait_s=0.05)
    learned(cap, {"b": 0.05}, 1.0)  # b due at 1.05
    learned(cap, {"a": 0.05}, 0.97)  # a answered in another batch, 30 ms earlier
    cap.arrive("a", 1.02)
    assert cap.hold_until({"a"}, 1.02, 1.02) == pytest.approx(1.05 + MIN_SLACK_S)  # 30 ms: > a forward, < cap
    assert cap.hold_until({"a"}, 0.99, 0.99) is None  # 60 ms away: past the cap
    assert twenty_ms_forwards(max_wait_s=0.01).hold_until({"a"}, 1.02, 1.02) is None


def test_hold_is_capped_and_jitter_widens_the_slack():
    cap = twenty_ms_forwards(max_wait_s=0.005)
    learned(cap, {"a": 0.04, "b": 0.05}, 1.0)
    assert cap.hold_until({"a"}, 1.046, 1.046) == pytest.approx(1.051)  # the 5 ms cap ends before b's slack
    assert cap.hold_until({"a"}, 1.04, 1.04) is None  # b is due after the capped window ends
    quarter = twenty_ms_forwards(wait_fraction=0.25)
    learned(quarter, {"a": 0.04, "b": 0.05}, 1.0)
    assert quarter.hold_until({"a"}, 1.04, 1.04) is None  # a quarter forward (5 ms) < 10 ms: not worth it
    never = twenty_ms_forwards(wait_fraction=0.0)
    learned(never, {"b": 0.05}, 1.0)
    assert never.hold_until({"a"}, 1.04, 1.04) is None  # fraction 0: no window at all, not even to align
    noisy = twenty_ms_forwards()
    for t, away in ((0.0, 0.05), (0.1, 0.06), (0.2, 0.04)):  # b's away time varies: it may come later than due
        noisy.answered(["a", "b"], t)
        noisy.arrive("b", t + away)
    b = noisy.streams["b"]
    assert b.jitter_s > 0.001
    noisy.answered(["a", "b"], 1.0)
    assert noisy.hold_until({"a"}, b.due() - 0.005, b.due()) == pytest.approx(b.due() + 2 * b.jitter_s)
    erratic = twenty_ms_forwards()
    for t, away in ((0.0, 0.05), (0.2, 0.09), (0.4, 0.05), (0.6, 0.09)):  # b comes back at no steady time
        erratic.answered(["a", "b"], t)
        erratic.arrive("b", t + away)
    erratic.answered(["a", "b"], 1.0)
    assert erratic.streams["b"].slack() > 0.02
    due = erratic.streams["b"].due()
    assert erratic.hold_until({"a"}, due - 0.005, due - 0.005) is None  # slack past one forward: not awaited
    paused = twenty_ms_forwards()
    learned(paused, {"a": 0.04, "b": 0.05}, 1.0)
    paused.arrive("b", 2.5)  # b decoded without the draft for 1.5 s, then came back
    paused.answered(["a", "b"], 2.52)
    assert paused.streams["b"].jitter_s == pytest.approx(0.0, abs=1e-12)  # a pause is not jitter ...
    assert paused.streams["b"].due() == pytest.approx(2.57)  # ... nor its rhythm


def simulate(wait_fraction: float, rounds: int = 300, seed: int = 0) -> tuple[float, float]:
    """Three callers of 4 rows each, away 90-110 ms between calls, draft forward 8 ms + 2 ms per row; the queue's
    policy on a fake clock: a free draft takes what is pending, held while `hold_until` says so.
    Returns (share of forwards with more than one caller, draft busy seconds per caller round)."""
    rng = random.Random(seed)
    cap = DraftCapacity(max_wait_s=0.05, wait_fraction=wait_fraction)
    arrival = {s: rng.uniform(0, 0.1) for s in "abc"}  # next call of each caller (None while in a batch)
    free, done = 0.0, 0
    while done < rounds:
        now = max(free, min(t for t in arrival.values() if t is not None))
        pending = {s for s, t in arrival.items() if t is not None and t <= now}
        for s in pending:
            cap.arrive(s, arrival[s])
        opened = now
        while (until := cap.hold_until(pending, opened, now)) is not None:
            now = min([until] + [t for s, t in arrival.items() if t is not None and s not in pending])
            late = {s for s, t in arrival.items() if t is not None and t <= now} - pending
            for s in late:
                cap.arrive(s, arrival[s])
            pending |= late
        end = now + 0.008 + 0.002 * 4 * len(pending)
        cap.forward([arrival[s] for s in pending], pending, 4 * len(pending), now, end)
        cap.answered(list(pending), end)
        for s in pending:
            arrival[s] = end + 0.1 * rng.uniform(0.9, 1.1)
        free, done = end, done + len(pending)
    return cap.num_merged_forwards / cap.num_forwards, cap.busy_s / done


def test_the_window_self_aligns_callers_into_shared_forwards():
    """Merged forwards release their callers together and similar away times bring them back together: with the
    window most forwards are shared (callers that drift out of phase are pulled back by one wait up to the cap);
    without it (the draft mostly idle) callers seldom meet, and the draft works more per round. A window of one
    forward alone (no aligning) would leave callers locked out of phase, which is why one longer wait aligns them."""
    for seed in range(3):
        shared, busy = simulate(wait_fraction=1.0, seed=seed)
        alone, busy_alone = simulate(wait_fraction=0.0, seed=seed)
        assert shared >= 0.75 and alone < 0.3, (seed, shared, alone)
        assert busy < 0.8 * busy_alone, (seed, busy, busy_alone)


def test_merge_queue_wakes_when_the_awaited_call_arrives():
    """Real asyncio: a's call is held for b's predicted call, which arrives 20 ms later: one batch with both, run
    well before the window's end; then b alone (a not due) runs at once."""
    async def main() -> tuple[list, list, float]:
        cap = DraftCapacity(max_wait_s=2.0, wait_fraction=1.0)
        cap.forward([0.0], {"a"}, 1, 0.0, 2.0)  # a 2 s forward: the window may last up to 2 s
        batches: list[list] = []

        async def run_batch(items: list) -> list:
            batches.append(items)
            return [f"done {i}" for i in items]

        queue = MergeQueue(cap, run_batch, max_calls=4)
        learned(cap, {"b": 0.02}, time.monotonic())
        t0 = time.monotonic()
        first = asyncio.ensure_future(queue.submit("a", "a1"))
        await asyncio.sleep(0.02)
        results = await asyncio.gather(first, queue.submit("b", "b1"))
        took = time.monotonic() - t0
        assert results == ["done a1", "done b1"]
        await queue.submit("b", "b2")  # a is not due again (never answered before): no hold
        return batches, [cap.num_holds, cap.wait_s], took

    batches, (holds, last_wait), took = asyncio.run(main())
    assert batches == [["a1", "b1"], ["b2"]]
    assert holds == 1 and last_wait == 0.0 and took < 1.0


def test_merge_queue_runs_alone_when_the_awaited_call_is_late_and_passes_errors_on():
    async def main() -> tuple[list, float, str]:
        cap = DraftCapacity(max_wait_s=2.0, wait_fraction=1.0)
        cap.forward([0.0], {"a"}, 1, 0.0, 2.0)
        batches: list[list] = []

        async def run_batch(items: list) -> list:
            batches.append(items)
            if "bad" in items:
                raise ValueError("bad row")
            return items

        queue = MergeQueue(cap, run_batch, max_calls=4)
        learned(cap, {"b": 0.05}, time.monotonic())  # b due in 50 ms, never comes
        assert await queue.submit("a", "a1") == "a1"
        held = cap.wait_s
        try:
            await queue.submit("a", "bad")
        except ValueError as exc:
            return batches, held, str(exc)
        return batches, held, ""

    batches, held, error = asyncio.run(main())
    assert batches == [["a1"], ["bad"]]  # the second call: b is late past its slack now, no hold
    assert 0.04 < held < 0.5 and error == "bad row"


def test_merge_queue_drafts_even_when_the_window_fails():
    class Broken(DraftCapacity):
        def hold_until(self, waiting: set, opened: float, now: float) -> float | None:
            raise ZeroDivisionError("a bug in the window")

    async def main() -> list:
        async def run_batch(items: list) -> list:
            return items

        queue = MergeQueue(Broken(max_wait_s=0.05), run_batch, max_calls=4)
        return await asyncio.wait_for(asyncio.gather(queue.submit("a", 1), queue.submit("b", 2)), 5.0)

    assert asyncio.run(main()) == [1, 2]


def test_stats_count_merges_busy_fraction_and_queueing():
    cap = DraftCapacity(max_wait_s=0.05)
    t0 = cap.started
    cap.num_calls = 3
    cap.forward([t0, t0 + 0.001], {"a", "b"}, 6, t0 + 0.002, t0 + 0.012)
    cap.forward([t0 + 0.02], {"a"}, 2, t0 + 0.02, t0 + 0.03)
    s = cap.stats()
    assert (s["num_forwards"], s["num_merged_forwards"], s["num_rows"], s["rows_per_forward"]) == (2, 1, 8, 4.0)
    assert s["num_merged_rows"] == 6  # the 2-target forward's rows; the lone target's 2 rows are not shared
    assert s["queue_delay_s"] == pytest.approx(0.003)
    assert s["mean_queue_delay_s"] == pytest.approx(0.001)
    assert s["busy_s"] == pytest.approx(0.02)
    assert cap.busy_fraction(t0 + 0.04) == pytest.approx(0.5)
    assert cap.busy_fraction(t0 + 100.0) == 0.0  # forwards older than the window no longer count


def test_prometheus_exports_the_draft_stats():
    m = ServeMetrics()
    m.record_draft({"num_calls": 7, "num_forwards": 5, "num_merged_forwards": 3, "busy_fraction": 0.25})
    m.record_draft({"error": "TimeoutError: "})  # an unreachable draft leaves the last values
    text = m.render().decode()
    assert "s2d:draft_num_merged_forwards 3.0" in text
    assert "s2d:draft_busy_fraction 0.25" in text
