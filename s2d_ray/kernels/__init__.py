"""The backend layer beside the engine: which kernels the core's layer stacks run on this machine.

The core asks through a small contract (core/kernels.py, `Kernels`); `CpuKernels` answers it on the CPU (grouped
attention with a measured innermost kernel, projections on packed weights where faster), deciding on the least time
each candidate ever took here (`TimingStore`); `DeterministicKernels` answers it with batch-invariant kernels
(`deterministic: true`). s2d_ray/build.py makes one from the config and injects it.
"""

from .attention import GROUPED, stock_attention
from .cpu import ATTENTION_KERNELS, LINEAR_KERNELS, CpuKernels
from .deterministic import DeterministicKernels
from .timing_store import TimingStore

__all__ = ["ATTENTION_KERNELS", "GROUPED", "LINEAR_KERNELS", "CpuKernels", "DeterministicKernels", "TimingStore",
           "stock_attention"]
