"""The kernel timings behind load-time choices (kernels/linear.py, kernels/attention.py), kept per machine on disk as
the least time each candidate ever took.

Why: a process measures its kernels when it loads a model, and `serve run` loads several replicas on the same cores
at once. A replica measuring beside busy neighbours sees slower times than a quiet process and could choose other
kernels from one start to the next, so a served target would run slower kernels than the same engine in process.
Load only ever adds time to a measurement, so the least time seen for a candidate over every process that measured
it on this machine estimates its time on a quiet one. Each process still measures; it merges its times into the file
(per key and candidate, the minimum) and decides on the merged minima, so one quiet measurement (any `s2d generate`,
the first replica, a test) fixes the choice for the processes that load later beside busy neighbours.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..hardware import machine_name

logger = logging.getLogger(__name__)

# Overrides the configured file for a process (`off`: decide on this process's measurement alone).
ENV_KERNEL_TIMES = "S2D_KERNEL_TIMES"


def machine_key() -> str:
    """What the stored times are keyed by besides the kernel: the machine and the torch version."""
    return f"{machine_name('cpu')} | torch {torch.__version__}"


@dataclass(frozen=True)
class TimingStore:
    """The least times per (machine, torch version, kernel and shape) and candidate, in one JSON file."""

    path: Path
    machine: str

    @classmethod
    def from_setting(cls, setting: str | None, default_path: Path) -> TimingStore | None:
        """The store a setting names (the environment's S2D_KERNEL_TIMES overrides it): a path, `off` (None: no
        store), or unset (`default_path`)."""
        value = os.environ.get(ENV_KERNEL_TIMES) or setting or ""
        if value.lower() == "off":
            return None
        return cls(Path(value).expanduser() if value else default_path, machine_key())

    def least(self, key: str, measured: dict[str, float]) -> dict[str, float]:
        """`measured`: candidate -> this process's best seconds for `key` (a kernel, shape, dtype and thread count).
        Returns, per candidate, the least of these and every time stored for this machine, and stores the result
        (under an exclusive lock: replicas load at once). A file that cannot be read or written leaves `measured` as
        it is."""
        path, full_key = self.path, f"{self.machine} | {key}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path.with_suffix(path.suffix + ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    stored = json.loads(path.read_text()) if path.exists() else {}
                except (OSError, ValueError):
                    stored = {}  # a torn or foreign file: start again
                before = stored.get(full_key, {})
                merged = {c: min(t, float(before.get(c, t))) for c, t in measured.items()}
                if merged != before:
                    stored[full_key] = merged
                    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
                        json.dump(stored, tmp, indent=0, sort_keys=True)
                    os.replace(tmp.name, path)
                return merged
        except OSError as exc:
            logger.debug("kernel times not kept (%s): %s", path, exc)
            return dict(measured)


def least_times(store: TimingStore | None, key: str, measured: dict[str, float]) -> dict[str, float]:
    """`store.least(key, measured)`, or `measured` itself without a store."""
    return dict(measured) if store is None else store.least(key, measured)
