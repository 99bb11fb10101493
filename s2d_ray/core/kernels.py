"""The kernel choice a LayerStack asks for when it is built: a small contract, implemented outside the core.

The core runs a Hugging Face decoder's layers as the model has them (its attention with a mask per head, torch's
F.linear): `STOCK`. Which kernels are faster depends on the machine (a CPU's instruction set, a process measuring
beside busy neighbours), so that choice is a backend's (s2d_ray/kernels/), given to the stack, the verifier and the
draft at construction. Any backend computes the same numbers up to rounding; exactness never depends on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class AttentionShape:
    """What an attention kernel choice depends on: the heads of a stack's layers, their dtype and device."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class AttentionKernel:
    """How a stack's layers attend once the backend has routed them.

    grouped: through core/attention.py's `grouped_attention` (row groups, cache runs, one mask for every head);
    False: the model's own attention with a mask per head. sdpa: grouped_attention's innermost kernel is torch's SDPA
    instead of grouped matmuls. row_invariant: every query row attends alone over exactly the keys it sees, in the
    call a one-token decode step makes (grouped_attention's `row_invariant`), so its output never depends on the
    other rows, the pass's width or a token tree's shape."""

    grouped: bool = False
    sdpa: bool = False
    row_invariant: bool = False


class Kernels(Protocol):
    """The backend contract: route attention, swap projections for faster equivalents, say what it chose."""

    def attention(self, layers: nn.ModuleList, shape: AttentionShape) -> AttentionKernel:
        """Route these decoder layers' attention (or leave it) and say how the stack calls it."""
        ...

    def projections(self, module: nn.Module) -> nn.Module:
        """`module`, or a structural copy of it sharing every parameter whose projections run faster kernels."""
        ...

    def weight_projection(self, weight: torch.Tensor) -> nn.Module | None:
        """A module computing x @ weight.T on a faster kernel than F.linear, or None (a reduced-vocabulary head)."""
        ...

    def describe(self, modules: Iterable[nn.Module | None]) -> dict[str, int]:
        """How many of `modules` run each of the backend's kernels (stats and /health)."""
        ...


class StockKernels:
    """torch's kernels as the model has them: nothing is routed, swapped or measured."""

    def attention(self, layers: nn.ModuleList, shape: AttentionShape) -> AttentionKernel:
        return AttentionKernel()

    def projections(self, module: nn.Module) -> nn.Module:
        return module

    def weight_projection(self, weight: torch.Tensor) -> nn.Module | None:
        return None

    def describe(self, modules: Iterable[nn.Module | None]) -> dict[str, int]:
        return {}


STOCK = StockKernels()
