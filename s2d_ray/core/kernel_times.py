"""The kernel timings behind load-time choices (core/linear.py, core/attention.py), kept per machine on disk as the
least time each candidate ever took.

Why: a process measures its kernels when it loads a model, and `serve run` loads several replicas on the same cores
at once. The instruct target of one shipped app ran oneDNN on 211, 151 or 121 of its 211 projections from one start
to the next (/health `kernels`, sessions 25-27), while the in-process engine, measured on a quiet machine, took all
211: the served target then ran slower kernels than its twin. Load only ever adds time to a measurement, so the least
time seen for a candidate over every process that measured it on this machine estimates its time on a quiet one.
Each process still measures; it merges its times into the file (per key and candidate, the minimum) and decides on
the merged minima, so one quiet measurement (any `s2d generate`, the first replica, a test) fixes the choice for the
processes that load later beside busy neighbours.

`S2D_KERNEL_TIMES`: the file (default `<cache dir>/kernel_times.json`; entries are keyed by machine, torch version,
kernel and shape); `off`: measure in process only, as before.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def times_path() -> Path | None:
    value = os.environ.get("S2D_KERNEL_TIMES", "")
    if value.lower() == "off":
        return None
    if value:
        return Path(value).expanduser()
    from ..models.sources import default_cache_dir

    return default_cache_dir() / "kernel_times.json"


def machine_key() -> str:
    from ..machines import machine_name

    return f"{machine_name('cpu')} | torch {torch.__version__}"


def least_times(key: str, measured: dict[str, float]) -> dict[str, float]:
    """`measured`: candidate -> this process's best seconds for `key` (a kernel, shape, dtype and thread count).
    Returns, per candidate, the least of these and every time stored for this machine, and stores the result (under
    an exclusive lock: replicas load at once). A file that cannot be read or written leaves `measured` as it is."""
    path = times_path()
    if path is None:
        return dict(measured)
    full_key = f"{machine_key()} | {key}"
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
