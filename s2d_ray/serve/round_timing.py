"""Where a served round spends its time, seen from the router: the round loop's own clock (`RoundTimes`) and, per
deployment the rounds call, the calls' wall time against what the replica reported spending (`CallTimes`). Their
difference is what a served round pays over an in-process one (Ray transport, batching, event loops)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator


@dataclass
class CallTimes:
    """Where a deployment's calls spend their time, seen from the router: the calls' wall seconds and what the
    replica reported spending on them (`Counted.seconds`: its forwards and model-thread hop). The difference is the
    price of the call itself (Ray transport, @serve.batch, the replica's event loop), paid once per round."""

    calls: int = 0
    wall_s: float = 0.0
    replica_s: float = 0.0
    replica_cpu_s: float = 0.0  # the model thread's CPU time in those calls (Counted.cpu_seconds; 0: not measured)
    observe: Callable[[float], None] | None = None  # e.g. a Prometheus histogram's observe, per call overhead

    def add(self, wall_s: float, replica_s: float, replica_cpu_s: float = 0.0) -> None:
        self.calls += 1
        self.wall_s += wall_s
        self.replica_s += replica_s
        self.replica_cpu_s += replica_cpu_s
        if self.observe is not None and replica_s > 0:
            self.observe(max(wall_s - replica_s, 0.0))

    def add_slowest(self, wall_s: float, replies: Iterator[Any]) -> None:
        """One round's call(s): the wall time, and the replica time of the slowest reply (a round split over replicas
        waits for it), or 0 when no replica answered."""
        slowest = max(replies, key=lambda reply: reply.seconds, default=None)
        self.add(wall_s, slowest.seconds if slowest else 0.0, slowest.cpu_seconds if slowest else 0.0)

    def summary(self) -> dict:
        n = max(self.calls, 1)
        return {"calls": self.calls, "mean_call_ms": 1e3 * self.wall_s / n,
                "mean_replica_ms": 1e3 * self.replica_s / n, "mean_replica_cpu_ms": 1e3 * self.replica_cpu_s / n,
                "mean_overhead_ms": 1e3 * (self.wall_s - self.replica_s) / n}


@dataclass
class RoundTimes:
    """The round loop's own clock: rounds, their wall seconds, and the gaps between back-to-back rounds (the router's
    bookkeeping between a round's end and the next one's start: events, admission, its event loop)."""

    rounds: int = 0
    round_s: float = 0.0
    gap_s: float = 0.0
    _last_end: float | None = None

    @contextlib.contextmanager
    def round(self) -> Iterator[None]:
        start = time.perf_counter()
        if self._last_end is not None:
            self.gap_s += start - self._last_end
        try:
            yield
        finally:
            self._last_end = time.perf_counter()
            self.rounds += 1
            self.round_s += self._last_end - start

    def idle(self) -> None:
        """No work: the wait for the next request is not a gap between rounds."""
        self._last_end = None

    def summary(self) -> dict:
        n = max(self.rounds, 1)
        return {"rounds": self.rounds, "mean_round_ms": 1e3 * self.round_s / n, "mean_gap_ms": 1e3 * self.gap_s / n}
