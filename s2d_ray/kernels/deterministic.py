"""The deterministic backend (`deterministic: true`): kernels whose result for a position never depends on the pass
it is computed in, as SGLang's deterministic inference and vLLM's batch-invariant mode do on GPUs.

Why: a GEMM's reduction order follows its row count (torch's CPU GEMM picks another kernel at one row than at
several, and in bf16 the MLP's down projection already parts between 4 and 5 rows), and attention over a padded,
masked key range sums its softmax in another order than over a row's own keys. So verifying k positions, a token
tree, a batch of sequences or a prompt rounds differently from decoding each position alone, and bf16 greedy
speculation parts from plain decoding at near-ties. Here:

- projections and the LM head run on rows padded with zeros to a multiple of CHUNK_ROWS, each call a GEMM of
  CHUNK_ROWS rows or of a larger row count this CPU has been seen to compute bit for bit as CHUNK_ROWS-row calls
  (`invariant_call_rows`: probed once per weight shape, dtype and thread count; a row count the probe did not
  confirm is never run), so a row's result depends on neither its place in the call nor the other rows; on the CPU
  on a weight reordered once (oneDNN), not on every call;
- attention gives each query row exactly its own keys in decode order (a tree node: its prefix and ancestors, as a
  decode step at that node reads them) and computes it in KEY_BLOCK-wide blocks of one matmul shape, summed by a
  sequential scan (`blocked_attention`): a row's result is the same whatever the pass's width, padding or other
  rows, so a whole pass runs in a few batched calls;
- every pass runs on the same intra-op thread count (`FixedPasses`): oneDNN may split a GEMM's reduction by it;
- norms, RoPE, activations and residual adds are per row already.

Then every position's KV and logits equal a one-token decode step's bit for bit, so greedy speculation equals plain
greedy decoding in this mode, and a repeat run repeats it. It costs speed: a decode step pads each projection to
CHUNK_ROWS rows, attention gathers every row's keys, and CUDA graphs are off.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core.attention import causal
from ..core.kernels import AttentionKernel, AttentionShape, PassRunner, PlainPasses
from .attention import CPU_GROUPED, use_grouped
from .linear import _packed_linear, supported, with_linears
from .threads import FixedPasses, intra_op_threads

CHUNK_ROWS = 8  # the row count every projection call is a multiple of: a decode step's one row pays for 8
# Larger calls a projection may make (rows in CHUNK_ROWS times a power of two), each only where the probe confirms it
# equals CHUNK_ROWS-row calls bit for bit: a pass of 40 rows is then a call of 32 and one of 8, not five of 8.
CALL_ROWS = tuple(CHUNK_ROWS << j for j in range(7))
KEY_BLOCK = 32  # keys per attention block (blocked_attention): every attention matmul the same shape
ROWS_PER_CALL = 64  # query rows per blocked_attention call: bounds the gathered keys of a long prompt's pass
MATMUL_MIN = 16 * 16 * 16  # torch's CPU matmul runs oneDNN above this many multiply-adds per call (reduced types)


@dataclass(frozen=True)
class CallKernel:
    """A projection's GEMM for one call's rows; `packed`: oneDNN on the reordered weight (the kernel the call-size
    probe vouches for; any other takes CHUNK_ROWS rows per call)."""

    run: Callable[[torch.Tensor], torch.Tensor]
    packed: bool

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return self.run(rows)


def call_plan(rows: int, sizes: tuple[int, ...]) -> list[int]:
    """`rows` (a multiple of CHUNK_ROWS) as calls of the allowed sizes, largest first (CHUNK_ROWS is always one)."""
    out, left = [], rows
    for size in sorted(sizes, reverse=True):
        while left >= size:
            out.append(size)
            left -= size
    return out


@functools.cache
def invariant_call_rows(out_features: int, in_features: int, dtype: torch.dtype, threads: int,
                        bias: bool) -> tuple[int, ...]:
    """The CALL_ROWS sizes whose rows the packed GEMM computes bit for bit as CHUNK_ROWS-row calls do, on this CPU at
    this thread count. oneDNN picks its kernel and blocking by shape, dtype, ISA and threads, never by the values, so
    one probe on random numbers per weight shape answers for every call of that shape; a size whose rows differ
    anywhere is left out (its calls are split further). Run inside a pass, so on the pass's thread count."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, CHUNK_ROWS)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    x = torch.randn(CALL_ROWS[-1], in_features, generator=gen).to(dtype)
    chunks = torch.cat([_packed_linear(c, packed, b) for c in x.split(CHUNK_ROWS)])
    return tuple(n for n in CALL_ROWS if n == CHUNK_ROWS or torch.equal(_packed_linear(x[:n], packed, b), chunks[:n]))


class RowChunkedLinear(nn.Module):
    """x @ weight.T + bias as GEMMs of CHUNK_ROWS rows or of the larger row counts `invariant_call_rows` confirms:
    batch-invariant (each row's result is the same in any pass). The weight and bias are the original tensors
    (shared, same state-dict keys).

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

    def _chunk_kernel(self, x: torch.Tensor) -> CallKernel:
        """The one kernel every call of this pass runs (the reordered copy, unless autograd or another device)."""
        if not self.reordered or x.device.type != "cpu" or torch.is_grad_enabled() and self.weight.requires_grad:
            return CallKernel(lambda chunk: F.linear(chunk, self.weight, self.bias), packed=False)
        packed, bias = self._reordered(), None if self.bias is None else self.bias.detach()
        return CallKernel(lambda chunk: _packed_linear(chunk, packed, bias), packed=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        flat = x.reshape(rows, x.shape[-1])
        pad = -rows % CHUNK_ROWS
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[-1])])
        flat = flat.contiguous()  # every call the same layout as a decode step's
        kernel = self._chunk_kernel(flat)
        sizes = (invariant_call_rows(self.out_features, self.in_features, flat.dtype, torch.get_num_threads(),
                                     self.bias is not None) if kernel.packed else (CHUNK_ROWS,))
        out = torch.cat([kernel(part) for part in flat.split(call_plan(len(flat), sizes))])
        return out[:rows].reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rows per call: multiples of {CHUNK_ROWS}")


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
    """query [b, h, q, d] over key/value [b', kvh, k, d] -> [b, q, h, d], each query row over exactly the keys its
    mask allows, gathered in slot order (a tree node: its prefix, its ancestors root first, itself: the keys a decode
    step at that node reads), padded to the widest row of its call. Every row goes through `blocked_attention`, whose
    result for a row depends on neither the padding nor the other rows, so calls take up to ROWS_PER_CALL rows of
    similar key counts. kv_runs maps query rows to key rows as in `grouped_attention`."""
    b, h, q, d = query.shape
    kvh, n_keys = key.shape[1], key.shape[2]
    if attention_mask is None:
        allowed = causal(q, n_keys, query.device)[None, None]
    elif attention_mask.dtype == torch.bool:
        allowed = attention_mask
    else:
        allowed = attention_mask > torch.finfo(attention_mask.dtype).min
    allowed = allowed[:, 0].expand(b, q, n_keys).reshape(b * q, n_keys)  # one mask row per query row
    key_rows = list(range(b)) if kv_runs is None else [ka + i - qa for qa, qb, ka, _ in kv_runs for i in range(qa, qb)]
    key_row = torch.tensor(key_rows, device=query.device).repeat_interleave(q)
    counts = allowed.sum(-1)
    rows = query.transpose(1, 2).reshape(b * q, kvh, h // kvh, d)
    out = torch.empty_like(rows)
    keys, values = _slot_rows(key), _slot_rows(value)
    heads = torch.arange(kvh, device=query.device)
    # One CPU thread: a second one would split these small calls in an order that may follow their size.
    with intra_op_threads(1 if query.device.type == "cpu" else None):
        # Rows of similar key counts together, so a call pads little; a row's result is the same in any call.
        for part in counts.argsort(stable=True).split(ROWS_PER_CALL):
            width = max(1, -(-int(counts[part[-1]]) // KEY_BLOCK)) * KEY_BLOCK
            valid = torch.arange(width, device=query.device)[None] < counts[part, None]  # each row's own keys
            slots = torch.zeros(valid.shape, dtype=torch.long, device=query.device)
            slots[valid] = allowed[part].nonzero()[:, 1]  # row-major both: allowed slots ascending, left-aligned
            # (query row, head, position) -> its key's row in the cache seen as rows. Padding points at slot 0: a
            # finite key whose score is masked, so its weight is an exact zero.
            k, v = (cache.index_select(0, (key_row[part, None, None] * row + heads[:, None] * head
                                           + slots[:, None] * slot).flatten()).view(len(part), kvh, width, d)
                    for cache, row, head, slot in (keys, values))
            out[part] = blocked_attention(rows[part], k, v, valid, scale)
    return out.view(b, q, h, d)


def _slot_rows(cache: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """cache [b', kvh, k, d] seen as rows of d, one per (cache row, head, slot), without a copy where the layout
    allows (a view of a larger cache buffer, heads inner or outer) -> (rows, row step, head step, slot step): slot s
    of (row i, head j) is row i * row step + j * head step + s * slot step."""
    d = cache.shape[3]

    def steps(t: torch.Tensor) -> list[int]:  # a size-1 dimension's stride is arbitrary: it never moves
        return [stride if size > 1 else 0 for stride, size in zip(t.stride(), t.shape)]

    found = steps(cache)
    if found[3] not in (0, 1) or any(step % d for step in found[:3]):
        cache = cache.contiguous()
        found = steps(cache)
    row, head, slot = (step // d for step in found[:3])
    count = sum((size - 1) * step for size, step in zip(cache.shape[:3], (row, head, slot))) + 1
    return cache.as_strided((count, d), (d, 1), cache.storage_offset()), row, head, slot


def blocked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """query [r, kvh, g, d] over key / value [r, kvh, n, d] (n a multiple of KEY_BLOCK), `valid` [r, n] marking each
    row's real keys, left-aligned -> [r, kvh, g, d].

    Batch-invariant by construction: keys are cut into KEY_BLOCK-wide blocks and every block is a matrix of its own
    in one batched matmul (each matrix the same shape, whatever the row count or width); a block's softmax weights
    and their sum are summed over the blocks by a sequential scan (cumsum), so the padding blocks past a row's keys
    add exact zeros at the end. A row's result is thus the one it gets alone, at its own width."""
    r, kvh, g, d = query.shape
    blocks = key.shape[2] // KEY_BLOCK
    acc = torch.promote_types(query.dtype, torch.float32)
    n = r * kvh * blocks
    q = query[:, :, None].expand(r, kvh, blocks, g, d).reshape(n, g, d)
    scores = _block_matmul(q, key.reshape(n, KEY_BLOCK, d), transpose=True).to(acc).mul_(scale)
    scores = scores.view(r, kvh, blocks, g, KEY_BLOCK)
    scores.masked_fill_(~valid.view(r, 1, blocks, 1, KEY_BLOCK), float("-inf"))
    top = scores.amax(dim=(2, 4), keepdim=True)  # exact, in any order
    weights = (scores - top.masked_fill(top.isinf(), 0)).exp_()  # a row without keys: all zero
    total = weights.sum(-1).cumsum(2)[:, :, -1]  # [r, kvh, g]
    part = _block_matmul(weights.to(value.dtype).view(n, g, KEY_BLOCK), value.reshape(n, KEY_BLOCK, d))
    out = part.view(r, kvh, blocks, g, d).to(acc).cumsum(2)[:, :, -1]
    return (out / total.clamp_min(torch.finfo(acc).tiny)[..., None]).to(value.dtype)


def _block_matmul(a: torch.Tensor, b: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """a [n, x, y] @ b [n, y, z] (b [n, z, y] transposed), on at least enough matrices that torch's CPU matmul takes
    its oneDNN kernel (it does above MATMUL_MIN multiply-adds per call): a call of one small row would otherwise take
    another kernel than the same row among many."""
    n = a.shape[0]
    short = MATMUL_MIN // (a.shape[1] * a.shape[2] * b.shape[1 if transpose else 2]) + 1 - n
    if short > 0:
        a, b = (torch.cat([t, t.new_zeros(short, *t.shape[1:])]) for t in (a, b))
    return torch.matmul(a, b.transpose(-1, -2) if transpose else b)[:n]
