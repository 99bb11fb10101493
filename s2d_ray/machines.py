"""Which machine a calibration profile's costs were measured on, and the costs for this one.

Costs are per machine, and not only in scale: the same bf16 grid of SmolLM2-135M measured 8 rows x 32 positions at
8.3 one-row steps on an AMD EPYC and 3.8 on an Intel Xeon with AMX (BENCHMARKS.md §0, session 14). The speculation
budget learns one factor online (how much dearer real rounds are), so a grid from another machine keeps its shape:
there trees are priced too dear (or too cheap) for what the hardware does. A profile therefore records the machine
its costs come from, may carry more machines' costs (`costs_by_machine`), and the engine takes this machine's.
A CPU is named by its model AND its widest matmul instruction set: cloud CPUs report one model name ("AMD EPYC")
for hosts with and without AVX512-BF16, where bf16 runs natively on one and ~10x slower on the other.
No torch import at module level (the router resolves profiles before any model loads).
"""

from __future__ import annotations

import copy
import logging
import platform
from pathlib import Path

from . import dtypes

logger = logging.getLogger(__name__)

_warned: set[tuple[str, str]] = set()


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (Linux /proc/cpuinfo; elsewhere what platform says)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# /proc/cpuinfo flag -> the instruction set named in a CPU's machine name, widest first
CPU_ISAS = (("amx_bf16", "amx"), ("avx512_bf16", "avx512_bf16"), ("avx512f", "avx512"), ("avx2", "avx2"))


def cpu_isa() -> str:
    """The CPU's widest matmul instruction set (amx, avx512_bf16, avx512, avx2), '' when none or unknown."""
    flags = dtypes.cpu_flags()
    return next((isa for flag, isa in CPU_ISAS if flag in flags), "")


def machine_name(device: str = "cpu") -> str:
    """What a cost grid is keyed by: the CUDA device's name, or the CPU's model name and instruction set, e.g.
    "AMD EPYC (avx512_bf16)"."""
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    isa = cpu_isa()
    return f"{cpu_model()} ({isa})" if isa else cpu_model()


def costs_machine(profile: dict) -> str | None:
    """The machine a profile's top-level costs were measured on (None: not recorded, profiles before session 14)."""
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
