"""The kernel choice a LayerStack asks for when it is built: a small contract, implemented outside the core.

The core runs a Hugging Face decoder's layers as the model has them (its attention with a mask per head, torch's
F.linear): `STOCK`. Which kernels are faster depends on the machine (a CPU's instruction set, a process measuring
beside busy neighbours), so that choice is a backend's (s2d_ray/kernels/), given to the stack, the verifier and the
draft at construction. Any backend computes the same numbers up to rounding; exactness never depends on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterable
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


# The kinds of pass an attention call belongs to, by its query rows (sequences) and queries per row: one sequence
# decoding, one sequence's token tree (up to TREE_MAX_QUERIES positions), one sequence's prompt, several sequences.
# The faster innermost kernel differs between them (on a bf16 CPU SDPA is twice as fast for a tree and several times
# slower for a batch), so it is chosen per kind.
ATTENTION_CASES = ("decode", "tree", "prompt", "batch")
TREE_MAX_QUERIES = 32


def attention_case(rows: int, queries: int) -> str:
    """The kind of pass (ATTENTION_CASES) with `rows` sequences of `queries` queries each."""
    if rows > 1:
        return "batch"
    return "decode" if queries == 1 else "tree" if queries <= TREE_MAX_QUERIES else "prompt"


@dataclass(frozen=True)
class GroupedTuning:
    """The sizes core/attention.py's grouped path runs by, which depend on the machine and are a backend's choice
    (the numbers are the same either way; only their speed differs).

    key_left_max: up to this many stacked queries per KV head, scores are computed as K @ Q^T (else Q @ K^T).
    group_overhead_slots: what one more attention group costs, in row-slots read (`plan_kv_groups`).
    query_block: queries per block of a prompt pass (`_attend_blocks`)."""

    key_left_max: int
    group_overhead_slots: int
    query_block: int


@dataclass(frozen=True)
class AttentionKernel:
    """How a stack's layers attend once the backend has routed them.

    grouped: through core/attention.py's `grouped_attention` (row groups, cache runs, one mask for every head);
    False: the model's own attention with a mask per head. sdpa: the kinds of pass (ATTENTION_CASES) whose innermost
    grouped_attention kernel is torch's SDPA instead of grouped matmuls. per_query: the backend's kernel in which every
    query row attends alone over exactly the keys it sees, in the call a one-token decode step makes, so its output
    never depends on the other rows, the pass's width or a token tree's shape (`row_invariant`). tuning: the
    grouped path's sizes (required when grouped)."""

    grouped: bool = False
    sdpa: frozenset[str] = frozenset()
    per_query: Callable | None = None  # (query, key, value, mask, scale, kv_runs) -> out: each query row alone
    tuning: GroupedTuning | None = None

    def __post_init__(self) -> None:
        if self.grouped and self.tuning is None:
            raise ValueError("a grouped AttentionKernel needs the backend's GroupedTuning")

    @property
    def row_invariant(self) -> bool:
        return self.per_query is not None


class PassRunner(Protocol):
    """How a stack's passes run on the machine (a CPU backend: each pass's intra-op thread count). The algorithm
    never depends on it; one runner per stack, since it may keep per-pass measurements."""

    def run(self, kind: Hashable, positions: int) -> contextlib.AbstractContextManager:
        """A context for one pass of `kind` (a segment index, or "head") over `positions` positions."""
        ...

    def chosen(self) -> dict[str, int]:
        """What the runner currently chooses (stats and /health)."""
        ...


class PlainPasses:
    """Every pass as the calling thread is set up: nothing chosen or measured."""

    def run(self, kind: Hashable, positions: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def chosen(self) -> dict[str, int]:
        return {}


class Kernels(Protocol):
    """The backend contract: route attention, swap projections for faster equivalents, run passes on the machine
    (threads), say what it chose."""

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

    def passes(self, device: torch.device) -> PassRunner:
        """A new runner for one stack's passes on `device`."""
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

    def passes(self, device: torch.device) -> PassRunner:
        return PlainPasses()


STOCK = StockKernels()
