"""Attention on the CPU: route Hugging Face decoder layers through the slot cache's grouped attention
(core/attention.py), and choose its innermost kernel per machine.

Which innermost kernel is faster depends on the CPU, the dtype and the kind of pass: on a CPU with native bf16 the
grouped matmuls are several times faster than torch's SDPA for a batch of decoding rows while SDPA is twice as fast
for one sequence's token tree; in float32 SDPA (with `enable_gqa`) often wins everywhere (see BENCHMARKS.md). So the
kernel is measured per kind of pass when a model loads (`sdpa_cases`), against the least time each candidate ever
took on this machine (kernels/timing_store.py).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..core import attention as core_attention
from ..core.cache import additive_mask
from ..core.kernels import GroupedTuning
from .timing_store import TimingStore, least_times

GROUPED = "s2d_grouped"  # the attention implementation name Hugging Face layers are routed to
# The grouped path's sizes on the CPU:
# - key_left_max: up to 24 stacked queries per KV head, K @ Q^T (BLAS reads the cache's K view, row stride kv_heads x
#   head_dim, as it is, where Q @ K^T makes torch copy every row's K first; with more queries the copy is shared by
#   enough of them that Q @ K^T wins again);
# - group_overhead_slots: one more attention group adds a few small ops a layer, which cost about as much as copying
#   and multiplying 1024 row-slots of K/V;
# - query_block: one block of 128 queries keeps its float32 scores in a 2 MB L2 cache, where a whole prompt pass's
#   scores fall out of cache on every elementwise pass over them.
CPU_GROUPED = GroupedTuning(key_left_max=24, group_overhead_slots=1024, query_block=128)
SDPA_MIN_GAIN = 0.75  # SDPA must take at most this share of the grouped time: a close call keeps the grouped kernel


@functools.lru_cache(maxsize=None)
def sdpa_cases(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               store: TimingStore | None = None, slots: int = 256, repeats: int = 12,
               tuning: GroupedTuning = CPU_GROUPED) -> frozenset[str]:
    """The kinds of pass (core/kernels.py ATTENTION_CASES) where torch's SDPA beats the grouped matmuls on this CPU
    for these heads and dtype (measured once per process, shape and store): one row decoding, a 16-node tree, one
    `tuning.query_block` block of a prompt, and 8 rows decoding over `slots` cached slots, with the additive masks the
    slot cache builds, alternated, best of `repeats` each. SDPA must win by a quarter: a host where the two are close
    keeps the grouped kernel every time instead of flipping between loads."""
    def case(rows: int, q: int) -> tuple:
        qry = torch.randn(rows, num_heads, q, head_dim).to(dtype)
        key = torch.randn(rows, slots, num_kv_heads, head_dim).to(dtype).transpose(1, 2)  # the cache's strided view
        value = torch.randn(rows, slots, num_kv_heads, head_dim).to(dtype).transpose(1, 2)
        mask = additive_mask(core_attention.causal(q, slots, qry.device).expand(rows, q, slots), dtype)
        return qry, key, value, mask

    cases = {"decode": case(1, 1), "tree": case(1, 16), "prompt": case(1, tuning.query_block),
             "batch": case(8, 1)}
    best = {name: {False: float("inf"), True: float("inf")} for name in cases}
    with torch.no_grad():
        for _ in range(repeats):
            for kernel in (False, True):
                for name, (qry, key, value, mask) in cases.items():
                    t0 = time.perf_counter()
                    core_attention.attend(qry, key, value, mask, head_dim ** -0.5, kernel, tuning.key_left_max)
                    best[name][kernel] = min(best[name][kernel], time.perf_counter() - t0)
    chosen = set()
    for name in cases:
        t = least_times(store, f"attention {num_heads}/{num_kv_heads}x{head_dim} {dtype} slots{slots} "
                        f"t{torch.get_num_threads()} {name}", {"grouped": best[name][False], "sdpa": best[name][True]})
        if t["sdpa"] < SDPA_MIN_GAIN * t["grouped"]:
            chosen.add(name)
    return frozenset(chosen)


def cpu_grouped_attention(*args, tuning: GroupedTuning = CPU_GROUPED, **kwargs):
    """`grouped_attention` with the CPU's sizes unless a stack passes its own (a model's own forward passes none)."""
    return core_attention.grouped_attention(*args, tuning=tuning, **kwargs)


def register() -> None:
    """Make `GROUPED` an attention implementation Hugging Face layers (and their own mask builder) accept."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED, cpu_grouped_attention)
    AttentionMaskInterface.register(GROUPED, sdpa_mask)


def use_grouped(layers: nn.ModuleList) -> None:
    """Route these decoder layers' attention through `grouped_attention` (their model's own forward too: the masks
    it builds are SDPA's, which the function takes)."""
    register()
    for layer in layers:
        config = getattr(getattr(layer, "self_attn", None), "config", None)
        if config is not None and config._attn_implementation != GROUPED:
            config._attn_implementation = GROUPED


@contextmanager
def stock_attention(*models: nn.Module | None, name: str = "sdpa") -> Iterator[None]:
    """Run models with Hugging Face's stock attention for the duration (the benchmarks' transformers baselines share
    the loaded target with the engine, and must stay what a transformers user gets)."""
    configs = {id(m.config): m.config for m in models if m is not None}
    before = {key: cfg._attn_implementation for key, cfg in configs.items()}
    try:
        for cfg in configs.values():
            cfg._attn_implementation = name
        yield
    finally:
        for key, cfg in configs.items():
            cfg._attn_implementation = before[key]
