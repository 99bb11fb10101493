"""The CPU backend's thread policy: how many intra-op threads each pass of a layer stack runs on.

A wide pass (a prompt, a token tree, a big batch) takes more cores than a one-row step: a replica that shares the
machine's cores with the draft, the router and the other replicas runs narrow steps on one thread; a wide pass is a
few larger matmuls that a second core speeds up, and it does not overlap the same router's draft forward: a round
drafts, then verifies. Beside a CPU-bound neighbour fewer threads can be faster than all (`AdaptiveThreads`).
The core asks through `core/kernels.py`'s `PassRunner` contract; `CpuPasses` and `FixedPasses` answer it."""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Iterator

import torch

# A pass over at least this many (padded) positions counts as wide. Alone, a second thread speeds every pass, even one
# row's step; served, giving it to one-row steps loses (the router, proxy and client share the cores between steps
# and a descheduled peer stalls the pass), while prompts, trees and many-row rounds gain (see BENCHMARKS.md).
WIDE_PASS_POSITIONS = 16


@contextlib.contextmanager
def intra_op_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op thread count on this thread set to n inside the block (None or the current count: as is)."""
    before = torch.get_num_threads()
    if not n or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pass_threads(wide_threads: int | None, positions: int) -> int | None:
    """The thread count a pass over `positions` positions runs with (None: the thread's own)."""
    return wide_threads if wide_threads and positions >= WIDE_PASS_POSITIONS else None


class AdaptiveThreads:
    """Chooses each pass's intra-op thread count from how fast passes of its shape actually ran.

    Alone, more threads speed every pass; beside a CPU-bound neighbour a pass split over all cores waits at every
    barrier for the thread the neighbour descheduled, and runs several times slower than on one core. So each pass
    kind (`key`: a segment and a size bucket) keeps its last few times per candidate count, runs on the fastest, and
    re-times the others now and then (every `probe_every` passes, and at once when a pass takes `jump` times its usual
    time): the count follows what the process actually gets. A probe runs a pass on a slower count, so while all
    threads stay fastest the interval doubles with every probe that confirms it, up to `max_probe_every`: losing
    cores shows as a jump anyway, and only a return to all threads (a neighbour that left) needs the probes, which
    keep `probe_every` while fewer threads are fastest.

    A neighbour that leaves should be followed within a few passes, not an interval: `idle` (hardware.IdleCores: the
    machine's idle cores since the last look) re-times a kind on fewer threads as soon as half the cores it leaves
    unused sit idle, at most every `idle_every` of its passes (doubling while such re-times lose: where the idle count
    misleads, as in a container, they fall back to the base rate). A re-time that beats the count in use is repeated
    on the next pass before the choice changes (the window holds times from before the change, and one lucky pass
    beside the neighbour should cost one pass, not a switch); once a kind finds all threads fastest again, every kind
    still on fewer re-times on its next pass, since the neighbour left for all of them (unless `idle` says the cores
    are still taken). One instance per stack, used from one thread."""

    def __init__(self, probe_every: int = 32, window: int = 3, jump: float = 3.0, max_probe_every: int = 512,
                 clock: Callable[[], float] = time.perf_counter, idle: Callable[[], float] | None = None,
                 idle_every: int = 4) -> None:
        self.probe_every, self.window, self.jump, self.clock = probe_every, window, jump, clock
        self.max_probe_every = max(max_probe_every, probe_every)
        self.idle, self.idle_every = idle, idle_every
        self._idle_every: dict[Hashable, int] = {}  # the key's current spacing of idle-cued re-times
        self._times: dict[Hashable, dict[int, deque[float]]] = {}
        self._calls: dict[Hashable, int] = {}  # passes since the key's last probe
        self._every: dict[Hashable, int] = {}  # the key's current probe interval
        self._probing: dict[Hashable, int] = {}  # keys whose last pass was a probe -> the count that was fastest
        self._probe: set[Hashable] = set()  # keys whose next pass re-times another count (a jump was seen)
        self._timed_at: dict[tuple[Hashable, int], int] = {}  # when each (key, count) was last timed
        self._tick = itertools.count()

    @staticmethod
    def candidates(most: int) -> list[int]:
        """All of `most`, half of them and one thread: the counts worth trying."""
        return sorted({most, max(1, most // 2), 1}, reverse=True)

    def choose(self, key: Hashable, most: int) -> int:
        """The thread count this pass of kind `key` runs with (at most `most`)."""
        counts = self.candidates(most)
        times = self._times.setdefault(key, {})
        for n in counts:  # every candidate timed once first, the widest first
            if not times.get(n):
                return n
        best = self._fastest(times)
        calls = self._calls[key] = self._calls.get(key, 0) + 1
        if key in self._probe or calls >= self._every.get(key, self.probe_every) or self._idle_cue(key, best, most):
            self._probe.discard(key)
            self._calls[key] = 0
            self._probing[key] = best
            others = [n for n in counts if n != best]
            return min(others, key=lambda n: self._timed_at.get((key, n), -1))
        return best

    def _idle_cue(self, key: Hashable, best: int, most: int) -> bool:
        """Whether idle cores say a kind on fewer threads should re-time now (the caller resets its pass count)."""
        if self.idle is None or best >= most or self._calls[key] < self._idle_every.get(key, self.idle_every):
            return False
        if not self._cores_idle(most, best):
            return False
        self._idle_every[key] = min(2 * self._idle_every.get(key, self.idle_every), self.probe_every)
        return True

    def _cores_idle(self, most: int, used: int) -> bool:
        """Whether half the cores a kind on `used` of `most` threads leaves unused sit idle (needs `idle`)."""
        return self.idle() >= (most - used) / 2

    @staticmethod
    def _fastest(times: dict[int, deque[float]]) -> int:
        return min((n for n in times if times[n]), key=lambda n: statistics.median(times[n]))

    def record(self, key: Hashable, threads: int, seconds: float) -> None:
        """A pass of kind `key` on `threads` threads took `seconds`."""
        by_count = self._times.setdefault(key, {})
        times = by_count.setdefault(threads, deque(maxlen=self.window))
        jumped = len(times) == self.window and seconds > self.jump * statistics.median(times)
        if jumped:
            self._probe.add(key)
        times.append(seconds)
        self._timed_at[(key, threads)] = next(self._tick)
        before = self._probing.pop(key, None)
        if jumped:
            self._every[key] = self.probe_every
        elif before is not None:  # a probe: back off while all threads stay fastest, else probe at the base rate
            fastest, widest = self._fastest(by_count), max(by_count)
            kept = fastest == before == widest  # still fastest, and it is all threads
            every = self._every.get(key, self.probe_every)
            self._every[key] = min(2 * every, self.max_probe_every) if kept else self.probe_every
            if fastest == before != threads and seconds < statistics.median(by_count[before]):
                self._probe.add(key)  # beat the count in use against older times: re-time it once more, next pass
            if fastest == widest != before:  # cores came back: every kind on fewer threads re-times now
                self._idle_every.pop(key, None)
                # unless the idle cores say the neighbour is still there (lucky passes): then this kind alone
                if self.idle is None or self._cores_idle(widest, before):
                    self._probe.update(k for k, t in self._times.items()
                                       if k != key and all(t.values()) and self._fastest(t) < max(t))

    @contextlib.contextmanager
    def run(self, key: Hashable, most: int | None = None) -> Iterator[None]:
        """Run the block on the count chosen for `key` (at most `most`, default torch's current count) and time it."""
        most = most or torch.get_num_threads()
        if most <= 1:
            yield
            return
        n = self.choose(key, most)
        start = self.clock()
        with intra_op_threads(n):
            yield
        self.record(key, n, self.clock() - start)

    def chosen(self) -> dict[str, int]:
        """How many pass kinds currently run on each count (stats and /health)."""
        out: dict[str, int] = {}
        for times in self._times.values():
            if all(times.values()):
                best = self._fastest(times)
                out[f"threads_{best}"] = out.get(f"threads_{best}", 0) + 1
        return out


def size_bucket(positions: int) -> int:
    """Passes over 1, 2, 3-4, 5-8, ... positions share timings: the next power of two."""
    return 1 << max(0, positions - 1).bit_length()


@dataclass
class CpuPasses:
    """The PassRunner (core/kernels.py) of one CPU stack: a segment's wide passes on `wide_threads`, narrow ones and
    the LM head on the thread's own count, or each pass kind (kind and size bucket) on the count `governor` measured
    fastest for it. One per stack."""

    wide_threads: int | None = None
    governor: AdaptiveThreads | None = None

    def run(self, kind: Hashable, positions: int) -> contextlib.AbstractContextManager:
        most = None if kind == "head" else pass_threads(self.wide_threads, positions)
        if self.governor is None:
            return intra_op_threads(most)
        return self.governor.run((kind, size_bucket(positions)), most)

    def chosen(self) -> dict[str, int]:
        return self.governor.chosen() if self.governor is not None else {}


@dataclass
class FixedPasses:
    """Every pass on exactly `threads` intra-op threads, whatever its width: a GEMM's reduction split can follow the
    thread count, so the deterministic backend keeps it the same for a decode step and a wide pass."""

    threads: int

    def run(self, kind: Hashable, positions: int) -> contextlib.AbstractContextManager:
        return intra_op_threads(self.threads)

    def chosen(self) -> dict[str, int]:
        return {f"threads_{self.threads}": 1}
