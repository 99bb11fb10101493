"""The machine this process runs on: its name, its CPU's model and widest matmul instruction set, the dtype
`dtype: auto` resolves to here, the calibration costs measured on it, how many of its cores sit idle (the thread
governor's cue), and what a benchmark records about it.

A CPU is named by its model AND its widest matmul instruction set: cloud CPUs report one model name ("AMD EPYC") for
hosts with and without AVX512-BF16, where bf16 runs natively on one and emulated, far slower, on the other.
No torch import at module level: the router and the serving config use this module before any model loads.
"""

from __future__ import annotations

import copy
import datetime as dt
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

CPUINFO = Path("/proc/cpuinfo")
PROC_STAT = Path("/proc/stat")
FAST_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo names of native bf16 arithmetic
# /proc/cpuinfo flag -> the instruction set named in a CPU's machine name, widest first
CPU_ISAS = (("amx_bf16", "amx"), ("avx512_bf16", "avx512_bf16"), ("avx512f", "avx512"), ("avx2", "avx2"))

_logged: set[tuple[str, str]] = set()  # dtype resolutions logged once per (device, outcome)
_warned: set[tuple[str, str]] = set()  # profiles warned about once per (profile, machine)


# --- the CPU and the machine's name -----------------------------------------------------------------------------


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name (Linux /proc/cpuinfo; elsewhere what platform says)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux); empty where they cannot be read."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_isa() -> str:
    """The CPU's widest matmul instruction set (amx, avx512_bf16, avx512, avx2), '' when none or unknown."""
    flags = cpu_flags()
    return next((isa for flag, isa in CPU_ISAS if flag in flags), "")


def machine_name(device: str = "cpu") -> str:
    """What cost grids and kernel timings are keyed by: the CUDA device's name, or the CPU's model name and
    instruction set, e.g. "AMD EPYC (avx512_bf16)"."""
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    isa = cpu_isa()
    return f"{cpu_model()} ({isa})" if isa else cpu_model()


# --- dtype resolution -------------------------------------------------------------------------------------------


def cuda_has_bf16() -> bool:
    """Whether the CUDA device runs bf16 natively; True when no GPU is visible here (a router planning for a GPU
    replica: every GPU since Ampere does)."""
    import torch

    return not torch.cuda.is_available() or torch.cuda.is_bf16_supported()


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """The dtype name to load weights in on `device` ("cpu" or "cuda"): `auto` becomes bfloat16 where it is the fast
    path, else float32 (logged once per outcome); any other name is returned as it is.

    bfloat16 halves the bytes every decode step reads, but only hardware with native bf16 arithmetic turns that into
    speed: on a CPU without AVX512-BF16 or AMX, bf16 matmuls are emulated and slower than float32."""
    if dtype != "auto":
        return dtype
    if device == "cuda":
        fast, why = cuda_has_bf16(), "CUDA bf16 support"
    else:
        found = sorted(cpu_flags() & FAST_BF16_CPU_FLAGS)
        fast, why = bool(found), f"CPU flags {', '.join(found)}" if found else "no AVX512-BF16/AMX on this CPU"
    resolved = "bfloat16" if fast else "float32"
    if (device, resolved) not in _logged:
        _logged.add((device, resolved))
        logger.info("dtype auto -> %s on %s (%s)", resolved, device, why)
    return resolved


# --- per-machine calibration costs ------------------------------------------------------------------------------
# Costs are per machine, and not only in scale: how many one-row steps a wide verification costs differs between CPU
# generations (see BENCHMARKS.md). The speculation budget learns one factor online (how much dearer real rounds are),
# so a grid from another machine keeps its shape: there trees are priced too dear (or too cheap) for what the
# hardware does. A profile therefore records the machine its costs come from, may carry more machines' costs
# (`costs_by_machine`), and the engine takes this machine's.


def costs_machine(profile: dict) -> str | None:
    """The machine a profile's top-level costs were measured on (None: the profile does not record it)."""
    return (profile.get("costs_measured") or {}).get("machine")


def for_machine(profile: dict | None, machine: str, name: str = "profile") -> dict | None:
    """The profile with `costs_ms` for `machine`: its `costs_by_machine` entry when there is one, else the profile as
    it is, with a warning (once) when its costs were measured on another machine."""
    if not profile or not profile.get("costs_ms"):
        return profile
    entry = (profile.get("costs_by_machine") or {}).get(machine)
    if entry is not None:
        chosen = copy.copy(profile)
        chosen["costs_ms"], chosen["costs_measured"] = entry["costs_ms"], entry.get("costs_measured", {})
        return chosen
    measured = costs_machine(profile)
    if measured is not None and measured != machine and (name, machine) not in _warned:
        _warned.add((name, machine))
        logger.warning("%s: costs measured on %s, this machine is %s; their shape (how cheap verifying more "
                       "positions is) may not hold here: `s2d calibrate --costs-only --profile %s` adds this "
                       "machine's", name, measured, machine, name)
    return profile


def store_costs(profile: dict, costs_ms: dict, measured: dict) -> dict:
    """A profile updated with costs just measured on `measured["machine"]`: the top-level costs when they were this
    machine's (or unrecorded), else an entry in `costs_by_machine` beside them."""
    machine, top = measured["machine"], costs_machine(profile)
    profile = dict(profile)
    if top is None or top == machine:
        profile["costs_ms"], profile["costs_measured"] = costs_ms, measured
    else:
        machines = dict(profile.get("costs_by_machine") or {})
        machines[machine] = {"costs_ms": costs_ms, "costs_measured": measured}
        profile["costs_by_machine"] = machines
    return profile


# --- idle cores ---------------------------------------------------------------------------------------------------


class IdleCores:
    """How many of the machine's cores sat idle, on average, since the previous look (Linux /proc/stat): a thread
    governor's cue that a neighbour has left. Looks closer together than `min_interval` return the last value (the
    counters tick every 10 ms per core)."""

    def __init__(self, stat: Path = PROC_STAT, min_interval: float = 0.05,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stat, self.min_interval, self.clock = stat, min_interval, clock
        self.cores = os.cpu_count() or 1
        self._last = self._read()
        self._at = self.clock()
        self._value = 0.0

    @classmethod
    def here(cls, stat: Path = PROC_STAT) -> IdleCores | None:
        """A reader where /proc/stat can be read, else None."""
        reader = cls(stat)
        return reader if reader._last is not None else None

    def _read(self) -> tuple[int, int] | None:
        """(idle, total) jiffies over all cores: idle + iowait, and user .. steal."""
        try:
            with open(self.stat) as f:
                fields = [int(v) for v in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        return (fields[3] + fields[4], sum(fields)) if len(fields) >= 5 else None

    def __call__(self) -> float:
        now = self.clock()
        if now - self._at < self.min_interval:
            return self._value
        current = self._read()
        if current is None or self._last is None:
            return 0.0
        idle, total = current[0] - self._last[0], current[1] - self._last[1]
        if total > 0:
            self._value = self.cores * idle / total
        self._last, self._at = current, now
        return self._value


# --- what a benchmark record says about the machine --------------------------------------------------------------


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the platform has none)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def machine_info() -> dict:
    """What a benchmark ran on, recorded with every result so figures from different machines are never mixed up."""
    import torch
    import transformers

    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpu_isa": cpu_isa(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": load_average(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "argv": recorded_argv(sys.argv),
    }


def recorded_argv(argv: list[str]) -> list[str]:
    """The command as a record keeps it: no install path, and the data directory named by its variable, so a record
    says how to rerun it on any machine rather than where one machine keeps its data."""
    data = os.environ.get("S2D_DATA_DIR", "").rstrip("/")
    out = [os.path.basename(argv[0]), *argv[1:]] if argv else []
    return ["$S2D_DATA_DIR" + a[len(data):] if data and (a == data or a.startswith(data + "/")) else a for a in out]
