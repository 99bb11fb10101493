"""How loaded the shared draft replica is, and how long a batch should wait for other targets' rounds.

The window adapts instead of a fixed `batch_wait_timeout_s`: with one target active, no other round is coming and
waiting only adds latency (0); with several, a call waits at most `wait_fraction` of the measured draft forward time
(merging saves a forward; waiting longer than a forward would cost more than it saves), capped by the configured
maximum. A target counts as active while its next round is expected from its measured inter-arrival time.
"""

from __future__ import annotations

import time
from collections import deque

EMA = 0.2  # weight of the newest sample in the forward-time and inter-arrival averages


class DraftCapacity:
    def __init__(self, max_wait_s: float, wait_fraction: float = 0.5, busy_window_s: float = 10.0) -> None:
        self.max_wait_s = max_wait_s
        self.wait_fraction = wait_fraction
        self.busy_window_s = busy_window_s
        self.started = time.monotonic()
        self.num_calls = 0  # propose calls received (one per target round)
        self.num_forwards = 0  # drafting runs (one per drafter per batch)
        self.num_rows = 0  # sequences drafted, over all forwards
        self.num_merged_forwards = 0  # forwards that drafted for more than one target
        self.num_merged_rows = 0  # rows drafted in those forwards: the share of drafting that was shared
        self.busy_s = 0.0  # model-thread seconds spent drafting
        self.queue_delay_s = 0.0  # summed over calls: arrival to the start of their forward
        self.forward_s = 0.0  # EMA of one forward's duration
        self.wait_s = 0.0  # the batching window set for the latest call
        self._last_arrival: dict[str, float] = {}
        self._interval: dict[str, float] = {}  # EMA of each target's time between rounds
        self._recent: deque[tuple[float, float]] = deque()  # (end, duration) of forwards in the busy window

    def arrive(self, target: str, now: float) -> float:
        """Record a call's arrival; return the batch wait to use for the batch it may start."""
        last = self._last_arrival.get(target)
        if last is not None:
            gap = now - last
            prev = self._interval.get(target)
            self._interval[target] = gap if prev is None else (1 - EMA) * prev + EMA * gap
        self._last_arrival[target] = now
        self.wait_s = self.window(target, now)
        return self.wait_s

    def window(self, target: str, now: float) -> float:
        """0 unless another target's round is expected soon; then a fraction of a forward."""
        others = [t for t in self._last_arrival if t != target and self._expected(t, now)]
        if not others or self.forward_s <= 0:
            return 0.0
        return min(self.max_wait_s, self.wait_fraction * self.forward_s)

    def _expected(self, target: str, now: float) -> bool:
        interval = self._interval.get(target)
        if interval is None:
            return False  # one call seen: no rate yet
        return now - self._last_arrival[target] < 2 * interval + self.forward_s

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
            "queue_delay_s": self.queue_delay_s,
            "mean_queue_delay_s": self.queue_delay_s / self.num_calls if self.num_calls else 0.0,
            "forward_s": self.forward_s, "batch_wait_timeout_s": self.wait_s, "uptime_s": now - self.started,
        }
