"""The deterministic backend (`deterministic: true`): kernels whose result for a position never depends on the pass
it is computed in, as SGLang's deterministic inference and vLLM's batch-invariant mode do on GPUs.

Why: a GEMM's reduction order follows its row count (torch's CPU GEMM picks another kernel at one row than at
several, and in bf16 the MLP's down projection already parts between 4 and 5 rows), and attention over a padded,
masked key range sums its softmax in another order than over a row's own keys. So verifying k positions, a token
tree, a batch of sequences or a prompt rounds differently from decoding each position alone, and bf16 greedy
speculation parts from plain decoding at near-ties. Here:

- projections and the LM head run on exactly CHUNK_ROWS rows per call (rows split into chunks, the last padded with
  zeros): every row goes through the same GEMM call shape, whose per-row result depends on neither the row's place
  in the chunk nor the other rows; on the CPU on a weight reordered once for that shape (oneDNN), not on every call;
- attention runs each query row alone over exactly its own keys in decode order (`per_query_attention`): a tree
  node over its prefix and ancestors, as a decode step at that node would;
- every pass runs on the same intra-op thread count (`FixedPasses`): oneDNN may split a GEMM's reduction by it;
- norms, RoPE, activations and residual adds are per row already.

Then every position's KV and logits equal a one-token decode step's bit for bit, so greedy speculation equals plain
greedy decoding in this mode, and a repeat run repeats it. It costs speed: a decode step pads each projection to
CHUNK_ROWS rows, a wide pass attends row by row, and CUDA graphs are off.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core.attention import causal
from ..core.kernels import AttentionKernel, AttentionShape, PassRunner, PlainPasses
from .attention import CPU_GROUPED, use_grouped
from .linear import _packed_linear, supported, with_linears
from .threads import FixedPasses, intra_op_threads

CHUNK_ROWS = 8  # rows per projection call: a decode step's one row pays for 8, a pass of 9..16 positions two calls


class RowChunkedLinear(nn.Module):
    """x @ weight.T + bias, always as GEMMs of CHUNK_ROWS rows: batch-invariant (each row's result is the same in
    any pass). The weight and bias are the original tensors (shared, same state-dict keys).

    On the CPU, where oneDNN takes the dtype (`linear.supported`: fp32, and bf16 / fp16 with the instructions), the
    chunks run on a copy of the weight reordered once for CHUNK_ROWS rows: the stock kernel reorders the weight on
    every call, which made most of the mode's cost. The choice follows the dtype and the CPU only, never a timing, so
    every run on one machine takes the same kernel and repeats its rounding."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.reordered = weight.device.type == "cpu" and weight.dtype != torch.float64 and supported(weight.dtype)
        self._copy: tuple[tuple, torch.Tensor] | None = None

    def _reordered(self) -> torch.Tensor:
        """The weight reordered for CHUNK_ROWS-row calls, remade when the weight changes (in-place updates)."""
        w = self.weight
        key = (w.data_ptr(), w._version, w.dtype)
        if self._copy is None or self._copy[0] != key:
            self._copy = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), CHUNK_ROWS))
        return self._copy[1]

    def _chunk_kernel(self, x: torch.Tensor):
        """The one kernel every chunk of this pass runs (the reordered copy, unless autograd or another device)."""
        if not self.reordered or x.device.type != "cpu" or torch.is_grad_enabled() and self.weight.requires_grad:
            return lambda chunk: F.linear(chunk, self.weight, self.bias)
        packed, bias = self._reordered(), None if self.bias is None else self.bias.detach()
        return lambda chunk: _packed_linear(chunk, packed, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        flat = x.reshape(rows, x.shape[-1])
        pad = -rows % CHUNK_ROWS
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[-1])])
        flat = flat.contiguous()  # every chunk the same layout as a decode step's
        kernel = self._chunk_kernel(flat)
        out = torch.cat([kernel(chunk) for chunk in flat.split(CHUNK_ROWS)])
        return out[:rows].reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows per call={CHUNK_ROWS}"


@dataclass(frozen=True)
class DeterministicKernels:
    """The Kernels contract (core/kernels.py) with batch-invariant kernels, on any device: row-chunked projections
    and per-query-row attention (module docstring)."""

    def attention(self, layers: nn.ModuleList, shape: AttentionShape) -> AttentionKernel:
        use_grouped(layers)
        return AttentionKernel(grouped=True, per_query=per_query_attention, tuning=CPU_GROUPED)

    def projections(self, module: nn.Module) -> nn.Module:
        return with_linears(module, lambda linear: RowChunkedLinear(linear.weight, linear.bias))

    def weight_projection(self, weight: torch.Tensor) -> nn.Module | None:
        return RowChunkedLinear(weight)

    def describe(self, modules: Iterable[nn.Module | None]) -> dict[str, int]:
        """Projections run as row chunks among `modules` and their children."""
        seen = {id(m): m for top in modules if top is not None for m in top.modules()
                if isinstance(m, RowChunkedLinear)}
        return {"row_chunked": len(seen), "chunk_rows": CHUNK_ROWS}

    def passes(self, device: torch.device) -> PassRunner:
        """Every pass on the process's configured thread count (a wide pass included): see FixedPasses."""
        return FixedPasses(torch.get_num_threads()) if device.type == "cpu" else PlainPasses()


def per_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scale: float,
                        kv_runs: list[tuple[int, int, int, int]] | None = None) -> torch.Tensor:
    """query [b, h, q, d] over key/value [b', kvh, k, d] -> [b, q, h, d], each query row computed alone over exactly
    the keys its mask allows, gathered in slot order (a tree node: its prefix, its ancestors root first, itself: the
    keys a decode step at that node reads), with one call shape per key count. So a row's output depends only on its
    own query and keys, never on the other rows, the pass's width or padding (a padded softmax or a wider matmul
    reduces in another order). kv_runs maps query rows to key rows as in `grouped_attention`."""
    b, h, q, d = query.shape
    if attention_mask is None:
        allowed = causal(q, key.shape[2], query.device)[None, None]
    elif attention_mask.dtype == torch.bool:
        allowed = attention_mask
    else:
        allowed = attention_mask > torch.finfo(attention_mask.dtype).min
    allowed = allowed[:, 0].expand(b, q, key.shape[2])  # one mask row per query row (the same for every head)
    key_rows = list(range(b)) if kv_runs is None else [ka + i - qa for qa, qb, ka, _ in kv_runs for i in range(qa, qb)]
    counts = allowed.sum(-1).flatten().tolist()
    slots = allowed.nonzero()[:, 2].split(counts)  # row-major: each query row's allowed slots, ascending
    rows = query.transpose(1, 2).contiguous()  # [b, q, h, d]: each query row one contiguous [h, d] block
    out = torch.empty_like(rows)
    # One CPU thread: these calls are too small to split, and a contended second thread only adds barrier waits.
    with intra_op_threads(1 if query.device.type == "cpu" else None):
        for n, idx in enumerate(slots):
            i, j = divmod(n, q)
            out[i, j] = _one_query(rows[i, j], key[key_rows[i]].index_select(1, idx),
                                   value[key_rows[i]].index_select(1, idx), scale)
    return out


def _one_query(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """query [h, d] over contiguous key/value [kvh, n, d] -> [h, d]: what every row of `per_query_attention` runs."""
    kvh, d = key.shape[0], key.shape[2]
    acc = torch.promote_types(query.dtype, torch.float32)
    scores = torch.matmul(query.view(kvh, -1, d), key.transpose(-1, -2)).to(acc) * scale
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.matmul(probs, value).view(-1, d)
