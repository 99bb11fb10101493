"""The deterministic backend (`deterministic: true`): kernels whose result for a position never depends on the pass
it is computed in, as SGLang's deterministic inference and vLLM's batch-invariant mode do on GPUs.

Why: a GEMM's reduction order follows its row count (torch's CPU GEMM picks another kernel at one row than at
several, and in bf16 the MLP's down projection already parts between 4 and 5 rows), and attention over a padded,
masked key range sums its softmax in another order than over a row's own keys. So verifying k positions, a token
tree, a batch of sequences or a prompt rounds differently from decoding each position alone, and bf16 greedy
speculation parts from plain decoding at near-ties. Here:

- projections and the LM head run on exactly CHUNK_ROWS rows per call (rows split into chunks, the last padded with
  zeros): every row goes through the same GEMM call shape, whose per-row result depends on neither the row's place
  in the chunk nor the other rows;
- attention runs each query row alone over exactly its own keys in decode order (core/attention.py,
  `per_query_attention`): a tree node over its prefix and ancestors, as a decode step at that node would;
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

from ..core.kernels import AttentionKernel, AttentionShape
from .attention import use_grouped
from .linear import with_linears

CHUNK_ROWS = 8  # rows per projection call: a decode step's one row pays for 8, a pass of 9..16 positions two calls


class RowChunkedLinear(nn.Module):
    """x @ weight.T + bias, always as GEMMs of CHUNK_ROWS rows: batch-invariant (each row's result is the same in
    any pass). The weight and bias are the original tensors (shared, same state-dict keys)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        flat = x.reshape(rows, x.shape[-1])
        pad = -rows % CHUNK_ROWS
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[-1])])
        flat = flat.contiguous()  # every chunk the same layout as a decode step's
        out = torch.cat([F.linear(chunk, self.weight, self.bias) for chunk in flat.split(CHUNK_ROWS)])
        return out[:rows].reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows per call={CHUNK_ROWS}"


@dataclass(frozen=True)
class DeterministicKernels:
    """The Kernels contract (core/kernels.py) with batch-invariant kernels, on any device: row-chunked projections
    and per-query-row attention (module docstring)."""

    def attention(self, layers: nn.ModuleList, shape: AttentionShape) -> AttentionKernel:
        use_grouped(layers)
        return AttentionKernel(grouped=True, row_invariant=True)

    def projections(self, module: nn.Module) -> nn.Module:
        return with_linears(module, lambda linear: RowChunkedLinear(linear.weight, linear.bias))

    def weight_projection(self, weight: torch.Tensor) -> nn.Module | None:
        return RowChunkedLinear(weight)

    def describe(self, modules: Iterable[nn.Module | None]) -> dict[str, int]:
        """Projections run as row chunks among `modules` and their children."""
        seen = {id(m): m for top in modules if top is not None for m in top.modules()
                if isinstance(m, RowChunkedLinear)}
        return {"row_chunked": len(seen), "chunk_rows": CHUNK_ROWS}
