"""Grouped-query attention as two matmuls, for the CPU: what the slot cache's layers call instead of SDPA.

Measured on this machine's CPU (torch 2.13, one thread, SmolLM2 shapes: 9 query / 3 KV heads, head dim 64), per layer:
decode of 8 rows over 1000 cached slots takes 6.1 ms with `scaled_dot_product_attention` in bfloat16 (6.9 ms in
float32, with or without `enable_gqa`) and 0.28 ms as grouped matmuls; 1 row over 1000 slots 0.76 vs 0.08 ms; a
25-node tree 0.84 vs 0.37 ms; a 400-token prompt 5.7 vs 2.2 ms. The queries of each KV head's group are stacked so
keys and values are never repeated, and the softmax runs in float32 (float64 stays float64) with the additive mask.
CUDA keeps SDPA (its fused kernels are the fast path there).

That was an AVX512-BF16 CPU. On an AVX2 CPU in float32 (torch 2.13, one thread) the same calls run the other way:
torch's SDPA with `enable_gqa` takes 68 us where the grouped matmuls take 211 (1 row, 200 slots), 133 vs 279 (a 9-node
tree), 335 vs 663 (8 rows). So the kernel is measured when a model loads (`sdpa_is_faster`) and the slot cache's
layers keep everything else (row groups, cache runs, query blocks) and call whichever is faster for the innermost
attention.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .cache import additive_mask
from .kernel_times import least_times

GROUPED = "s2d_grouped"
# Up to this many stacked queries per KV head, scores are computed as K @ Q^T: BLAS reads the cache's K view (row
# stride kv_heads x head_dim) as it is, where Q @ K^T made torch copy every row's K first. 8 decode rows over 830
# slots: 219 us a layer against 825; from ~16 queries on, Q @ K^T wins again (measured, BENCHMARKS.md §3).
KEY_LEFT_MAX = 24
# What one more attention group costs, in row-slots read (plan_kv_groups): ~6 more small ops a layer, ~0.1 ms, against
# ~0.06 us per row-slot of K/V copied and multiplied (bf16, SmolLM2 shapes, one thread; BENCHMARKS.md §3).
GROUP_OVERHEAD_SLOTS = 1024
# Queries per block of a prompt pass (_attend_blocks): one block's float32 scores stay in this CPU's 2 MB L2 cache.
# A 256-position pass over 768 slots: 8.9 ms a layer in one block, 2.7 in blocks of 128 (bf16, one thread).
QUERY_BLOCK = 128


def grouped_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    kv_groups: list[tuple[torch.Tensor, int]] | None = None,
    kv_runs: list[tuple[int, int, int, int]] | None = None,
    sdpa: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [b, h, q, d], key/value [b, kvh, k, d], mask additive or bool, broadcastable to [b, h, q, k] (None:
    causal, aligned to the last key). Returns ([b, q, h, d], None) as Hugging Face attention functions do.

    kv_groups (`plan_kv_groups`): rows that attend apart, each group over only its own first slots, so short rows
    beside a long one stop reading (and copying) the long row's slots; their masks hide those slots anyway.

    kv_runs (`SlotKVCache.select`): key/value hold the covering range of the query rows' cache rows (holes included,
    a view, not a copy); run (qa, qb, ka, kb) pairs query rows qa..qb-1 with key rows ka..kb-1.

    sdpa: the innermost attention runs as torch's SDPA instead of the grouped matmuls (`sdpa_is_faster`)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if kv_runs is not None and (kv_groups is None or attention_mask is None):
        b, h, q, d = query.shape
        out = query.new_empty(b, q, h, d)
        for qa, qb, ka, kb in kv_runs:
            mask = attention_mask if attention_mask is None or attention_mask.shape[0] == 1 else attention_mask[qa:qb]
            out[qa:qb] = _attend_blocks(query[qa:qb], key[ka:kb], value[ka:kb], mask, scale, sdpa)
        return out, None
    if kv_groups is None or attention_mask is None:
        return _attend_blocks(query, key, value, attention_mask, scale, sdpa), None
    b, h, q, d = query.shape
    out = query.new_empty(b, q, h, d)
    key_rows = None
    if kv_runs is not None:  # query row -> its row in the covering range
        key_rows = torch.cat([torch.arange(ka, kb, device=query.device) for _, _, ka, kb in kv_runs])
    for rows, length in kv_groups:
        mask = attention_mask if attention_mask.shape[0] == 1 else attention_mask.index_select(0, rows)
        krows = rows if key_rows is None else key_rows.index_select(0, rows)
        # index_select, not key[rows]: it copies a strided view ~7x faster than advanced indexing here
        out[rows] = _attend_blocks(query.index_select(0, rows), key[:, :, :length].index_select(0, krows),
                                   value[:, :, :length].index_select(0, krows), mask[..., :length], scale, sdpa)
    return out, None


def _attend_blocks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                   scale: float, sdpa: bool = False) -> torch.Tensor:
    """Many queries (a prompt pass) in blocks of QUERY_BLOCK, each over keys up to the last one its mask allows: the
    float32 scores of a whole 256-position pass over 768 slots (7 MB a layer) fall out of cache on every elementwise
    pass, and a causal block never needs the keys after its last position. Masked keys weigh exactly 0 either way."""
    q = query.shape[2]
    if attention_mask is None or q <= QUERY_BLOCK:
        return _attend(query, key, value, attention_mask, scale, sdpa)
    allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask > torch.finfo(
        attention_mask.dtype).min
    parts = []
    for lo in range(0, q, QUERY_BLOCK):
        hi = min(q, lo + QUERY_BLOCK)
        block = allowed[..., lo:hi, :] if allowed.shape[-2] == q else allowed
        cols = block.reshape(-1, block.shape[-1]).any(0).nonzero()
        k = int(cols.max()) + 1 if cols.numel() else key.shape[2]
        mask = attention_mask[..., lo:hi, :k] if attention_mask.shape[-2] == q else attention_mask[..., :k]
        parts.append(_attend(query[:, :, lo:hi], key[:, :, :k], value[:, :, :k], mask, scale, sdpa))
    return torch.cat(parts, dim=1)


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
            scale: float, sdpa: bool = False) -> torch.Tensor:
    b, h, q, d = query.shape
    kvh, k = key.shape[1], key.shape[2]
    if sdpa:
        if attention_mask is None:
            mask = _causal(q, k, query.device) if q > 1 else None
        else:
            mask = attention_mask[..., :k]
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                               enable_gqa=kvh != h)
        return out.transpose(1, 2).contiguous()
    g = h // kvh
    acc = torch.promote_types(query.dtype, torch.float32)
    stacked = query.reshape(b, kvh, g * q, d)
    if g * q <= KEY_LEFT_MAX:  # keys as the left operand: a cheaper matmul over the cache's strided view
        scores = torch.matmul(key, stacked.transpose(-1, -2)).transpose(-1, -2)
    else:
        scores = torch.matmul(stacked, key.transpose(-1, -2))
    scores = scores.reshape(b, kvh, g, q, k).to(acc) * scale
    if attention_mask is None:
        if q > 1:
            scores = scores.masked_fill(~_causal(q, k, query.device), torch.finfo(acc).min)
    else:
        mask = attention_mask[..., :k]
        mask = mask.reshape(mask.shape[0], kvh if mask.shape[1] == h else 1, g if mask.shape[1] == h else 1, q, k)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(acc).min)
        else:
            scores = scores + mask.to(acc)
    probs = torch.softmax(scores, dim=-1).to(value.dtype).view(b, kvh, g * q, k)
    out = torch.matmul(probs, value).view(b, h, q, d)
    return out.transpose(1, 2).contiguous()


def _causal(q: int, k: int, device: torch.device) -> torch.Tensor:
    """[q, k] bool: the last q of k positions, each seeing keys up to its own (causal, aligned to the last key)."""
    return torch.ones(q, k, dtype=torch.bool, device=device).tril(k - q)


@functools.lru_cache(maxsize=None)
def sdpa_is_faster(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, slots: int = 256,
                   repeats: int = 12) -> bool:
    """Whether torch's SDPA beats the grouped matmuls on this CPU for these heads and dtype (measured once per
    process and shape, ~50 ms): one row decoding, a 16-node tree, and 8 rows decoding over `slots` cached slots, with
    the additive masks the slot cache builds, alternated, best of `repeats` each. SDPA must win by a quarter: a host
    where the two are close keeps the grouped kernel every time instead of flipping between loads."""
    def case(rows: int, q: int) -> tuple:
        qry = torch.randn(rows, num_heads, q, head_dim).to(dtype)
        key = torch.randn(rows, slots, num_kv_heads, head_dim).to(dtype).transpose(1, 2)  # the cache's strided view
        value = torch.randn(rows, slots, num_kv_heads, head_dim).to(dtype).transpose(1, 2)
        return qry, key, value, additive_mask(_causal(q, slots, qry.device).expand(rows, q, slots), dtype)

    cases = [case(1, 1), case(1, 16), case(8, 1)]
    best = {False: [float("inf")] * len(cases), True: [float("inf")] * len(cases)}
    with torch.no_grad():
        for _ in range(repeats):
            for kernel in (False, True):
                for i, (qry, key, value, mask) in enumerate(cases):
                    t0 = time.perf_counter()
                    _attend(qry, key, value, mask, head_dim ** -0.5, kernel)
                    best[kernel][i] = min(best[kernel][i], time.perf_counter() - t0)
    t = least_times(f"attention {num_heads}/{num_kv_heads}x{head_dim} {dtype} slots{slots} "
                    f"t{torch.get_num_threads()}", {"grouped": sum(best[False]), "sdpa": sum(best[True])})
    return t["sdpa"] < 0.75 * t["grouped"]


def plan_kv_groups(lengths: list[int], overhead: int | None = None) -> list[list[int]] | None:
    """Rows (indices into `lengths`, each row's visible slots) split into groups that attend apart, by a cost of
    `overhead` + rows x longest length per group, minimised over splits of the rows sorted by length (exact, n^2);
    None when one group is cheapest. Every slot a row's attention reads is copied once before its matmul (torch's
    batched matmul copies strided views), so padding short rows to a long one costs what their extra slots cost."""
    overhead = GROUP_OVERHEAD_SLOTS if overhead is None else overhead
    n = len(lengths)
    if n < 2:
        return None
    order = sorted(range(n), key=lambda i: lengths[i])
    # Cuts only between runs of equal length: moving a run's row from the next group into the one that ends with its
    # length adds that length there and saves the next group's longest (>= it). So the search is over distinct
    # lengths (m^2, not n^2: thousands of rows of one prompt are one run).
    ends = [0] + [j for j in range(1, n + 1) if j == n or lengths[order[j]] != lengths[order[j - 1]]]
    m = len(ends) - 1
    if m == 1:
        return None
    best = [0.0] + [float("inf")] * m  # best[b]: cost of the rows in the first b runs
    cut = [0] * (m + 1)
    for b in range(1, m + 1):
        j, longest = ends[b], lengths[order[ends[b] - 1]]
        for a in range(b):
            cost = best[a] + overhead + (j - ends[a]) * longest
            if cost < best[b]:
                best[b], cut[b] = cost, a
    groups, b = [], m
    while b > 0:
        groups.append(order[ends[cut[b]]:ends[b]])
        b = cut[b]
    return None if len(groups) == 1 else groups[::-1]


def register() -> None:
    """Make `GROUPED` an attention implementation Hugging Face layers (and their own mask builder) accept."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED, grouped_attention)
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
