"""Pauses of Python's cyclic garbage collector in a serving process, counted for stats() and /health.

A full (generation 2) collection walks every tracked object of the process: a replica holding Ray, Serve, FastAPI,
transformers and torch has hundreds of thousands of them, so one walk can hold a round for a large fraction of a
second, in the middle of whichever round allocated the object that triggered it. Serve freezes a replica's heap once
its __init__ returns (RAY_SERVE_FREEZE_GC_ON_STARTUP, on by default in Ray 2.60), so collections while serving walk
only what was made since; these counters show whether that holds (`frozen`, and the last full collections' pauses).
"""

from __future__ import annotations

import gc
import threading
import time

RECENT = 8  # full collections whose pauses are kept one by one


class GCPauses:
    """Collections and the time they held the interpreter, per generation, for the whole process (gc.callbacks)."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = [0.0, 0.0, 0.0]
        self.recent_full: list[float] = []  # the last RECENT full collections' pauses (s), oldest first
        self._start = 0.0  # collections run one at a time, under the GIL

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        gen, spent = info["generation"], time.perf_counter() - self._start
        self.count[gen] += 1
        self.seconds[gen] += spent
        self.longest[gen] = max(self.longest[gen], spent)
        if gen == 2:
            self.recent_full = [*self.recent_full[1 - RECENT:], spent]

    def snapshot(self) -> dict:
        """Per generation: collections, total and longest pause (ms); the last full collections' pauses; the objects
        frozen out of every collection in this process (Serve freezes a replica's heap after its __init__)."""
        out = {f"gen{g}": {"collections": self.count[g], "ms": round(1e3 * self.seconds[g], 1),
                           "longest_ms": round(1e3 * self.longest[g], 2)} for g in range(3)}
        out["gen2"]["recent_ms"] = [round(1e3 * s, 1) for s in self.recent_full]
        return {**out, "frozen": gc.get_freeze_count()}


_pauses: GCPauses | None = None
_lock = threading.Lock()


def gc_pauses() -> GCPauses:
    """The process's one recorder, installed in gc.callbacks on first use (a replica's __init__ calls it first)."""
    global _pauses
    with _lock:
        if _pauses is None:
            _pauses = GCPauses()
            gc.callbacks.append(_pauses)
        return _pauses
