"""The CPU backend: which kernels a LayerStack's attention and projections run on, measured per machine at load.

Attention goes through the slot cache's grouped path (core/attention.py) with the innermost kernel that measured
faster here (kernels/attention.py); projections run on weights packed once where that measured faster per shape
(kernels/linear.py). Anything not on the CPU keeps torch's stock kernels.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..core.kernels import ATTENTION_CASES, AttentionKernel, AttentionShape, GroupedTuning, PassRunner, PlainPasses
from ..errors import ConfigError
from .attention import CPU_GROUPED, sdpa_cases, use_grouped
from .linear import (
    PackedLinear, one_row_is_faster, one_row_supported, packed, packed_is_faster, supported, with_packed_linears,
)
from .threads import AdaptiveThreads, CpuPasses
from .timing_store import TimingStore

# Projections: "auto" (packed weights where measured faster per shape: oneDNN for several rows, MKL for one row),
# "several" (the several-row choice only; one row stock), "stock" (torch's F.linear everywhere) or "packed" (every
# Linear both ways where the dtype allows).
LINEAR_KERNELS = ("auto", "several", "stock", "packed")
# The innermost attention kernel: "auto" (measured per kind of pass), "grouped" (matmuls) or "sdpa" (torch's SDPA).
ATTENTION_KERNELS = ("auto", "grouped", "sdpa")
ENV_LINEAR_KERNEL = "S2D_LINEAR_KERNEL"  # overrides the configured projections for a process (benchmarks' A/B)


@dataclass(frozen=True)
class CpuKernels:
    """The Kernels contract (core/kernels.py) on the CPU; `times`: where measurements are merged (None: this
    process's alone); `wide_threads`: intra-op threads for wide passes (None: the thread's own count);
    `adaptive_threads`: each stack's passes run on the thread count measured fastest for them (AdaptiveThreads),
    cued by a reader of the machine's idle cores that `idle_cores` makes per stack (hardware.IdleCores.here);
    False: the counts as configured. `tuning`: the grouped attention path's sizes (`CPU_GROUPED`)."""

    linear: str = "auto"
    attention_kernel: str = "auto"
    times: TimingStore | None = None
    wide_threads: int | None = None
    adaptive_threads: bool = False
    idle_cores: Callable[[], Callable[[], float] | None] | None = None
    tuning: GroupedTuning = CPU_GROUPED

    def __post_init__(self) -> None:
        if self.linear not in LINEAR_KERNELS:
            raise ConfigError(f"linear kernel {self.linear!r}: expected one of {', '.join(LINEAR_KERNELS)}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ConfigError(f"attention kernel {self.attention_kernel!r}: expected one of "
                              f"{', '.join(ATTENTION_KERNELS)}")

    @classmethod
    def from_settings(cls, linear: str, kernel_times: str | None, default_times: Path,
                      wide_threads: int | None = None, adaptive_threads: bool = False,
                      idle_cores: Callable[[], Callable[[], float] | None] | None = None) -> CpuKernels:
        """The backend configured settings ask for; S2D_LINEAR_KERNEL and S2D_KERNEL_TIMES override them."""
        return cls(linear=os.environ.get(ENV_LINEAR_KERNEL) or linear,
                   times=TimingStore.from_setting(kernel_times, default_times), wide_threads=wide_threads,
                   adaptive_threads=adaptive_threads, idle_cores=idle_cores)

    def passes(self, device: torch.device) -> PassRunner:
        """A stack's thread policy: only the CPU has threads to choose."""
        if device.type != "cpu":
            return PlainPasses()
        idle = self.idle_cores() if self.idle_cores is not None else None
        governor = AdaptiveThreads(idle=idle) if self.adaptive_threads else None
        return CpuPasses(self.wide_threads, governor)

    def attention(self, layers: nn.ModuleList, shape: AttentionShape) -> AttentionKernel:
        if shape.device.type != "cpu":
            return AttentionKernel()
        use_grouped(layers)
        if self.attention_kernel == "auto":
            sdpa = sdpa_cases(shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.dtype, self.times,
                              tuning=self.tuning)
        else:
            sdpa = frozenset(ATTENTION_CASES if self.attention_kernel == "sdpa" else ())
        return AttentionKernel(grouped=True, sdpa=sdpa, tuning=self.tuning)

    def projections(self, module: nn.Module) -> nn.Module:
        if self.linear == "stock":
            return module
        if type(module) is nn.Linear:
            choice = self._chosen(module.weight)
            return packed(module, *choice) if any(choice) else module
        return with_packed_linears(module, lambda linear: self._chosen(linear.weight))

    def weight_projection(self, weight: torch.Tensor) -> nn.Module | None:
        if self.linear == "stock":
            return None
        several, one_row = self._chosen(weight)
        return PackedLinear(weight, several=several, one_row=one_row) if several or one_row else None

    def describe(self, modules: Iterable[nn.Module | None]) -> dict[str, int]:
        """Projections packed for several rows (oneDNN) and for one row (MKL) among `modules` and their children."""
        seen = {id(m): m for top in modules if top is not None for m in top.modules() if isinstance(m, PackedLinear)}
        return {"packed_several": sum(m.several for m in seen.values()),
                "packed_one_row": sum(m.one_row for m in seen.values())}

    def _chosen(self, weight: torch.Tensor) -> tuple[bool, bool]:
        """(several rows packed, one row packed) for a weight: measured per shape, dtype and thread count."""
        if weight.device.type != "cpu":
            return False, False
        if self.linear == "packed":
            return supported(weight.dtype), one_row_supported(weight.dtype)
        out_f, in_f = weight.shape
        threads = torch.get_num_threads()
        one = self.linear == "auto" and one_row_is_faster(out_f, in_f, weight.dtype, threads, self.times)
        return packed_is_faster(out_f, in_f, weight.dtype, threads, self.times), one
