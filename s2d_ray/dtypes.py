"""`dtype: auto`, resolved in one place: bfloat16 where it is the fast path, float32 elsewhere.

bfloat16 halves the bytes every decode step reads, but only hardware with native bf16 arithmetic turns that into
speed: on a CPU without AVX512-BF16 or AMX, bf16 matmuls are emulated and slower than float32. No torch import at
module level: the serving config resolves dtypes for replicas before any model is loaded.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

FAST_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo names of native bf16 arithmetic
_logged: set[tuple[str, str]] = set()


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux); empty where they cannot be read."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cuda_has_bf16() -> bool:
    """Whether the CUDA device runs bf16 natively; True when no GPU is visible here (a router planning for a GPU
    replica: every GPU since Ampere does)."""
    import torch

    return not torch.cuda.is_available() or torch.cuda.is_bf16_supported()


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """The dtype name to load weights in on `device` ("cpu" or "cuda"): `auto` becomes bfloat16 where it is the fast
    path, else float32 (logged once per outcome); any other name is returned as it is."""
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
