"""A CPU-bound neighbour process for `s2d bench spec --busy-neighbour`: each method also runs beside it.

A server or laptop is rarely idle. The neighbour is one busy loop pinned to the last core, paused (SIGSTOP) except
while a `<method>+busy` generation runs, so the alone and beside runs of every method interleave per question and see
the same machine otherwise."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import Iterator

from ..core.types import SamplingParams

BUSY = "+busy"  # the suffix of a method's name when it runs beside the neighbour


class BusyNeighbour:
    """One busy-loop process on one core, paused until `busy()`."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> BusyNeighbour:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if len(cores) > 1:
            os.sched_setaffinity(self.proc.pid, {cores[-1]})
        self.proc.send_signal(signal.SIGSTOP)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        assert self.proc is not None, "enter the neighbour first"
        self.proc.send_signal(signal.SIGCONT)
        try:
            yield
        finally:
            self.proc.send_signal(signal.SIGSTOP)


class BesideNeighbour:
    """A bench method run while the neighbour is busy; named `<method>+busy`."""

    def __init__(self, inner, neighbour: BusyNeighbour) -> None:
        self.inner, self.neighbour = inner, neighbour
        self.name = inner.name + BUSY
        self.lossless = inner.lossless

    def generate(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams):
        with self.neighbour.busy():
            return self.inner.generate(prompt_ids, max_new_tokens, params)
