"""How loaded the shared draft replica is, and when a batch of propose calls should wait for another target's round.

Every caller (one target's decode loop in one router: a *stream*) sends one propose call per round and, once
answered, stays away for its verification and bookkeeping before the next one. The draft measures each stream's away
time and its jitter, so it can predict the stream's next call. A batch waits only for streams due soon and steady
enough to be predicted: within `wait_fraction` of one measured forward for a stream that left with the batch (merging
saves it a forward of its own), within the cap `max_wait_s` for a stream out of phase (one wait aligns it: streams
answered by the same forward leave together and, with similar away times, come back together). The batch runs as
soon as every awaited stream has arrived, or one is late past its jitter. One stream alone never waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Hashable

logger = logging.getLogger(__name__)

EMA = 0.2  # weight of the newest sample in the forward-time, away-time and jitter averages
MIN_SLACK_S = 0.001  # a due stream is awaited at least this long past its predicted arrival
GAP = 2.0  # a caller away longer than this many times its mean skipped rounds: not a sample of its rhythm


@dataclass
class Stream:
    """One caller's rounds: when its last call was answered and how long it stays away between calls."""

    answered: float | None = None  # when the batch holding its last call finished
    batch: int = -1  # which batch that was: streams answered together come back together unless their away differs
    away_s: float | None = None  # EMA of answered -> next arrival
    jitter_s: float = 0.0  # EMA of |away - predicted away|

    def due(self) -> float | None:
        return None if self.answered is None or self.away_s is None else self.answered + self.away_s

    def slack(self) -> float:
        return max(2 * self.jitter_s, MIN_SLACK_S)


class DraftCapacity:
    def __init__(self, max_wait_s: float, wait_fraction: float = 1.0, busy_window_s: float = 10.0) -> None:
        self.max_wait_s = max_wait_s
        self.wait_fraction = wait_fraction
        self.busy_window_s = busy_window_s
        self.started = time.monotonic()
        self.num_calls = 0  # propose calls received (one per target round)
        self.num_forwards = 0  # drafting runs (one per drafter per batch)
        self.num_rows = 0  # sequences drafted, over all forwards
        self.num_merged_forwards = 0  # forwards that drafted for more than one target
        self.num_merged_rows = 0  # rows drafted in those forwards: the share of drafting that was shared
        self.num_holds = 0  # batches held open for another stream's call
        self.hold_s = 0.0  # seconds batches were held open (part of the queue delay)
        self.busy_s = 0.0  # model-thread seconds spent drafting
        self.queue_delay_s = 0.0  # summed over calls: arrival to the start of their forward
        self.forward_s = 0.0  # EMA of one forward's duration
        self.wait_s = 0.0  # the hold of the latest batch
        self.streams: dict[Hashable, Stream] = {}
        self._batches = 0
        self._recent: deque[tuple[float, float]] = deque()  # (end, duration) of forwards in the busy window

    def arrive(self, stream: Hashable, now: float) -> None:
        """Record a call's arrival: the stream's away time since its last answer (and how much that varies)."""
        self.num_calls += 1
        s = self.streams.setdefault(stream, Stream())
        if s.answered is None:
            return
        away = now - s.answered
        if s.away_s is None:
            s.away_s = away
        elif away <= GAP * s.away_s:
            s.jitter_s = (1 - EMA) * s.jitter_s + EMA * abs(away - s.away_s)
            s.away_s = (1 - EMA) * s.away_s + EMA * away
        # else: the caller skipped the draft for some rounds (plain decoding, no work): back to its usual rhythm

    def answered(self, streams: list[Hashable], now: float) -> None:
        self._batches += 1
        for key in streams:
            s = self.streams.setdefault(key, Stream())
            s.answered, s.batch = now, self._batches

    def hold_until(self, waiting: set, opened: float, now: float) -> float | None:
        """When a batch whose calls come from `waiting`, ready since `opened`, may stop waiting; None: run now.

        A stream that left with one of the waiting calls is due later by its steadily longer away time, a wait paid
        every round: its window is `wait_fraction` of one forward (what merging saves). Any other stream is out of
        phase: one wait up to the cap aligns it, and from then on it leaves and comes back with the others. Awaited:
        every other stream due within its window from `opened`, not late past its slack, and steady enough (slack
        within the window: a caller whose away time varies more comes back at no predictable time, and waiting for
        it would only delay this batch). The hold lasts until the last awaited stream is due plus its slack, within
        its window."""
        steady = min(self.max_wait_s, self.wait_fraction * self.forward_s)
        align = self.max_wait_s if self.wait_fraction > 0 else 0.0
        batches = {self.streams[k].batch for k in waiting if k in self.streams}
        until = None
        for key, s in self.streams.items():
            due = s.due()
            if key in waiting or due is None or now >= due + s.slack():
                continue  # arrived, unknown, or late
            window = steady if s.batch in batches else align
            if due <= opened + window and s.slack() <= window:  # due, and predictable within the window
                end = opened + window
                stop = min(end, due + s.slack())
                until = stop if until is None else max(until, stop)
        return None if until is None or until <= now else until

    def held(self, seconds: float) -> None:
        self.wait_s = seconds
        if seconds > 0:
            self.num_holds += 1
            self.hold_s += seconds

    def forward(self, arrivals: list[float], targets: set[str], rows: int, start: float, end: float) -> None:
        """Record one forward: the calls it served (their arrival times), their targets and rows, its span."""
        duration = end - start
        self.num_forwards += 1
        self.num_rows += rows
        self.num_merged_forwards += len(targets) > 1
        self.num_merged_rows += rows if len(targets) > 1 else 0
        self.busy_s += duration
        self.queue_delay_s += sum(start - a for a in arrivals)
        self.forward_s = duration if self.num_forwards == 1 else (1 - EMA) * self.forward_s + EMA * duration
        self._recent.append((end, duration))

    def busy_fraction(self, now: float) -> float:
        """Model-thread busy seconds over wall seconds, in the last `busy_window_s` (since start when younger)."""
        while self._recent and self._recent[0][0] < now - self.busy_window_s:
            self._recent.popleft()
        span = min(self.busy_window_s, now - self.started)
        return min(1.0, sum(d for _, d in self._recent) / span) if span > 0 else 0.0

    def stats(self) -> dict:
        now = time.monotonic()
        return {
            "num_calls": self.num_calls, "num_forwards": self.num_forwards, "num_rows": self.num_rows,
            "num_merged_forwards": self.num_merged_forwards, "num_merged_rows": self.num_merged_rows,
            "rows_per_forward": self.num_rows / self.num_forwards if self.num_forwards else 0.0,
            "busy_s": self.busy_s, "busy_fraction": self.busy_fraction(now),
            "queue_delay_s": self.queue_delay_s, "num_holds": self.num_holds, "hold_s": self.hold_s,
            "mean_queue_delay_s": self.queue_delay_s / self.num_calls if self.num_calls else 0.0,
            "forward_s": self.forward_s, "batch_wait_timeout_s": self.wait_s, "uptime_s": now - self.started,
            "streams": {"/".join(map(str, k)) if isinstance(k, tuple) else str(k):
                        {"away_s": s.away_s, "jitter_s": s.jitter_s} for k, s in self.streams.items()},
        }


@dataclass
class _Call:
    stream: Hashable
    item: Any
    future: asyncio.Future


class MergeQueue:
    """Propose calls queue here; one task drafts them batch after batch, holding a batch open while
    `DraftCapacity.hold_until` expects another stream's call, and waking as soon as one arrives.

    One batch runs at a time (the draft has one model thread), so calls that arrive during a forward all go into
    the next one. `run_batch` gets the items of up to `max_calls` calls and returns one result per item."""

    def __init__(self, capacity: DraftCapacity, run_batch: Callable[[list], Awaitable[list]], max_calls: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity, self.run_batch, self.max_calls, self.clock = capacity, run_batch, max_calls, clock
        self.pending: list[_Call] = []
        self._arrived = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def submit(self, stream: Hashable, item: Any) -> Any:
        self.capacity.arrive(stream, self.clock())
        call = _Call(stream, item, asyncio.get_running_loop().create_future())
        self.pending.append(call)
        self._arrived.set()
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._drain())
        return await call.future

    async def _drain(self) -> None:
        while self.pending:
            try:
                await self._hold()
            except Exception:  # the window is an optimisation: a fault in it must never strand the queued calls
                logger.exception("merge window failed; drafting the queued calls now")
            batch, self.pending = self.pending[:self.max_calls], self.pending[self.max_calls:]
            batch = [c for c in batch if not c.future.done()]  # callers that gave up (cancelled) are skipped
            if not batch:
                continue
            try:
                results = await self.run_batch([c.item for c in batch])
            except Exception as exc:  # every caller of the batch gets the failure; the queue keeps serving
                for c in batch:
                    if not c.future.done():
                        c.future.set_exception(exc)
                continue
            finally:
                self.capacity.answered([c.stream for c in batch], self.clock())
            for c, r in zip(batch, results):
                if not c.future.done():
                    c.future.set_result(r)

    async def _hold(self) -> None:
        opened, waited = self.clock(), False
        while len(self.pending) < self.max_calls:
            until = self.capacity.hold_until({c.stream for c in self.pending}, opened, self.clock())
            if until is None:
                break
            self._arrived.clear()
            waited = True
            try:
                await asyncio.wait_for(self._arrived.wait(), until - self.clock())
            except asyncio.TimeoutError:
                pass
        self.capacity.held(self.clock() - opened if waited else 0.0)
