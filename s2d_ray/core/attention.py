"""Grouped-query attention as two matmuls, for the CPU: what the slot cache's layers call instead of SDPA.

The queries of each KV head's group are stacked so keys and values are never repeated, and the softmax runs in
float32 (float64 stays float64) with the additive mask. On CPUs with native bf16 this is several times faster than
torch's SDPA for decode rows, token trees and prompts (see BENCHMARKS.md); on some AVX2 CPUs in float32 SDPA is the
faster innermost kernel. So the layers keep everything around it here (row groups, cache runs, query blocks) and a
backend (s2d_ray/kernels/) routes them here, chooses the innermost kernel per machine (`sdpa=`) and gives the sizes
the path runs by (`tuning`, core/kernels.py `GroupedTuning`). CUDA keeps SDPA (its fused kernels are the fast path
there).
"""

from __future__ import annotations

import torch
from torch import nn

from .kernels import GroupedTuning


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
    per_query=None,
    *,
    tuning: GroupedTuning,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [b, h, q, d], key/value [b, kvh, k, d], mask additive or bool, broadcastable to [b, h, q, k] (None:
    causal, aligned to the last key). Returns ([b, q, h, d], None) as Hugging Face attention functions do.

    kv_groups (`plan_kv_groups`): rows that attend apart, each group over only its own first slots, so short rows
    beside a long one stop reading (and copying) the long row's slots; their masks hide those slots anyway.

    kv_runs (`SlotKVCache.select`): key/value hold the covering range of the query rows' cache rows (holes included,
    a view, not a copy); run (qa, qb, ka, kb) pairs query rows qa..qb-1 with key rows ka..kb-1.

    sdpa: the innermost attention runs as torch's SDPA instead of the grouped matmuls (a backend's choice).

    tuning: the sizes the path runs by (a backend's choice; the result is the same up to rounding).

    per_query: a backend's kernel in which each query row attends alone, bit-identical to a decode step's row
    (kernels/deterministic.py); it takes (query, key, value, mask, scale, kv_runs)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if per_query is not None:
        return per_query(query, key, value, attention_mask, scale, kv_runs), None
    if kv_runs is not None and (kv_groups is None or attention_mask is None):
        b, h, q, d = query.shape
        out = query.new_empty(b, q, h, d)
        for qa, qb, ka, kb in kv_runs:
            mask = attention_mask if attention_mask is None or attention_mask.shape[0] == 1 else attention_mask[qa:qb]
            out[qa:qb] = _attend_blocks(query[qa:qb], key[ka:kb], value[ka:kb], mask, scale, sdpa, tuning)
        return out, None
    if kv_groups is None or attention_mask is None:
        return _attend_blocks(query, key, value, attention_mask, scale, sdpa, tuning), None
    b, h, q, d = query.shape
    out = query.new_empty(b, q, h, d)
    key_rows = None
    if kv_runs is not None:  # query row -> its row in the covering range
        key_rows = torch.cat([torch.arange(ka, kb, device=query.device) for _, _, ka, kb in kv_runs])
    for rows, length in kv_groups:
        mask = attention_mask if attention_mask.shape[0] == 1 else attention_mask.index_select(0, rows)
        krows = rows if key_rows is None else key_rows.index_select(0, rows)
        # index_select, not key[rows]: it copies a strided view several times faster than advanced indexing
        out[rows] = _attend_blocks(query.index_select(0, rows), key[:, :, :length].index_select(0, krows),
                                   value[:, :, :length].index_select(0, krows), mask[..., :length], scale, sdpa,
                                   tuning)
    return out, None


def _attend_blocks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                   scale: float, sdpa: bool, tuning: GroupedTuning) -> torch.Tensor:
    """Many queries (a prompt pass) in blocks of `tuning.query_block`, each over keys up to the last one its mask
    allows: the float32 scores of a whole long pass fall out of cache on every elementwise pass, and a causal block
    never needs the keys after its last position. Masked keys weigh exactly 0 either way."""
    q, block_size = query.shape[2], tuning.query_block
    if attention_mask is None or q <= block_size:
        return attend(query, key, value, attention_mask, scale, sdpa, tuning.key_left_max)
    allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask > torch.finfo(
        attention_mask.dtype).min
    parts = []
    for lo in range(0, q, block_size):
        hi = min(q, lo + block_size)
        block = allowed[..., lo:hi, :] if allowed.shape[-2] == q else allowed
        cols = block.reshape(-1, block.shape[-1]).any(0).nonzero()
        k = int(cols.max()) + 1 if cols.numel() else key.shape[2]
        mask = attention_mask[..., lo:hi, :k] if attention_mask.shape[-2] == q else attention_mask[..., :k]
        parts.append(attend(query[:, :, lo:hi], key[:, :, :k], value[:, :, :k], mask, scale, sdpa,
                            tuning.key_left_max))
    return torch.cat(parts, dim=1)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
           scale: float, sdpa: bool, key_left_max: int) -> torch.Tensor:
    """One block of queries over its keys: torch's SDPA, or the grouped matmuls with keys as the left operand up to
    `key_left_max` stacked queries per KV head (BLAS then reads the cache's strided K view as it is, where Q @ K^T
    makes torch copy every row's K first; with more queries that copy is shared by enough of them)."""
    b, h, q, d = query.shape
    kvh, k = key.shape[1], key.shape[2]
    if sdpa:
        if attention_mask is None:
            mask = causal(q, k, query.device) if q > 1 else None
        else:
            mask = attention_mask[..., :k]
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                               enable_gqa=kvh != h)
        return out.transpose(1, 2).contiguous()
    g = h // kvh
    acc = torch.promote_types(query.dtype, torch.float32)
    stacked = query.reshape(b, kvh, g * q, d)
    if g * q <= key_left_max:  # keys as the left operand: a cheaper matmul over the cache's strided view
        scores = torch.matmul(key, stacked.transpose(-1, -2)).transpose(-1, -2)
    else:
        scores = torch.matmul(stacked, key.transpose(-1, -2))
    scores = scores.reshape(b, kvh, g, q, k).to(acc) * scale
    if attention_mask is None:
        if q > 1:
            scores = scores.masked_fill(~causal(q, k, query.device), torch.finfo(acc).min)
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


def causal(q: int, k: int, device: torch.device) -> torch.Tensor:
    """[q, k] bool: the last q of k positions, each seeing keys up to its own (causal, aligned to the last key)."""
    return torch.ones(q, k, dtype=torch.bool, device=device).tril(k - q)


def plan_kv_groups(lengths: list[int], overhead: int) -> list[list[int]] | None:
    """Rows (indices into `lengths`, each row's visible slots) split into groups that attend apart, by a cost of
    `overhead` + rows x longest length per group, minimised over splits of the rows sorted by length (exact, n^2);
    None when one group is cheapest. Every slot a row's attention reads is copied once before its matmul (torch's
    batched matmul copies strided views), so padding short rows to a long one costs what their extra slots cost."""
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
