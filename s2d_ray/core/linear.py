"""CPU projections for several rows: oneDNN with the weight packed once, where that measured faster on this CPU.

Why: verification and batched decoding push 2-32 rows through every projection. On an AVX2 CPU in fp32 the stock
kernel (MKL's GEMM) costs 1.7-3.5x a single row's GEMV already at 2-3 rows (it repacks the weight on every call), so
verifying a second position cost 1.5 decode steps and no draft could pay for it. oneDNN's linear with a weight
reordered once (`torch.ops.mkldnn._reorder_linear_weight`, what torch inductor's CPU weight prepacking calls) runs
2-3 rows for about one row's time on the large shapes (the MLP, the LM head), and loses on small ones (k/v). So the
choice is measured per weight shape when a stack asks for it (`packed_is_faster`), and one row always takes the
stock kernel: plain decoding runs exactly what it ran before. The packed copy costs the weight's memory once more.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

PACK_ROWS = 16  # the batch-size hint the weight is reordered for: one packed copy serves 2..32 rows near their best
TIMED_ROWS = (2, 4, 8)  # what verification and batched decoding push through (a decode step's 1 row is never packed)
MIN_GAIN = 0.8  # packed must take at most this share of the stock time over TIMED_ROWS (a close call stays stock)


@functools.lru_cache(maxsize=None)
def supported(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU pack weights of this dtype (fp32 everywhere; bf16 / fp16 only with the
    instructions oneDNN needs; never fp64)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        _packed_linear(torch.ones(2, 8, dtype=dtype), _pack(torch.ones(4, 8, dtype=dtype)), None)
    except RuntimeError:
        return False
    return True


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")


@functools.lru_cache(maxsize=None)
def packed_is_faster(out_features: int, in_features: int, dtype: torch.dtype, threads: int, repeats: int = 5) -> bool:
    """Whether the packed kernel beats the stock one for this weight shape and dtype on this CPU at 2, 4 and 8 rows
    (summed; best of `repeats`, alternated; several weights so that they do not all sit in cache). Once per process,
    shape, dtype and thread count: ~10-500 ms for a 135M model's five shapes, most of it the LM head."""
    if not supported(dtype):
        return False
    try:
        count = max(1, min(24, (32 << 20) // (out_features * in_features * torch.finfo(dtype).bits // 8)))
        weights = [torch.randn(out_features, in_features).to(dtype) for _ in range(count)]
        packed = [_pack(w) for w in weights]
        inputs = {m: torch.randn(m, in_features).to(dtype) for m in TIMED_ROWS}
        best = {False: dict.fromkeys(TIMED_ROWS, float("inf")), True: dict.fromkeys(TIMED_ROWS, float("inf"))}
        if out_features * in_features > (4 << 20):
            repeats = min(repeats, 3)  # the LM head: ~20 ms a call, and its choice is never close
        with torch.no_grad():
            for _ in range(repeats):
                for use_packed in (False, True):
                    for m, x in inputs.items():
                        t0 = time.perf_counter()
                        for w, p in zip(weights, packed):
                            _packed_linear(x, p, None) if use_packed else F.linear(x, w)
                        best[use_packed][m] = min(best[use_packed][m], time.perf_counter() - t0)
    except RuntimeError as exc:  # a shape oneDNN does not take: the stock kernel
        logger.debug("packed linear unavailable for %s: %s", dtype, exc)
        return False
    stock, packed_s = sum(best[False].values()), sum(best[True].values())
    logger.debug("linear %dx%d %s: stock %.2f ms, packed %.2f ms (rows %s)", out_features, in_features, dtype,
                 stock * 1e3, packed_s * 1e3, TIMED_ROWS)
    return packed_s < MIN_GAIN * stock


class PackedLinear(nn.Module):
    """A Linear whose several-row calls run oneDNN on a packed copy of the weight; one row (or none), autograd and
    non-CPU inputs run the stock kernel. The weight and bias are the original Parameters (shared, same state-dict keys); the
    packed copy follows them: it is remade when the weight changes (in-place updates bump its version)."""

    def __init__(self, weight: nn.Parameter | torch.Tensor, bias: nn.Parameter | torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self._packed: torch.Tensor | None = None
        self._key: tuple | None = None

    def packed(self) -> torch.Tensor:
        w = self.weight
        key = (w.data_ptr(), w._version, w.dtype)
        if key != self._key:
            self._packed, self._key = _pack(w), key
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.numel() <= x.shape[-1] or x.device.type != "cpu" or self.weight.device.type != "cpu"
                or torch.is_grad_enabled() and self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)
        return _packed_linear(x, self.packed(), None if self.bias is None else self.bias.detach())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for several rows"


# One PackedLinear per original Linear (a target's first layers also serve a cut draft: packed once).
_WRAPPED: weakref.WeakKeyDictionary[nn.Linear, PackedLinear] = weakref.WeakKeyDictionary()


def packed(linear: nn.Linear) -> PackedLinear:
    if linear not in _WRAPPED:
        _WRAPPED[linear] = PackedLinear(linear.weight, linear.bias)
    return _WRAPPED[linear]


def with_packed_linears(module: nn.Module, chosen) -> nn.Module:
    """A structural copy of `module` whose Linear children that `chosen(linear)` accepts are PackedLinear; every
    parameter, buffer and untouched submodule is shared with the original, which is left as it was (a Hugging Face
    model's own forward and `generate` keep the stock kernels)."""
    if type(module) is nn.Linear:
        return packed(module) if chosen(module) else module
    children = {name: with_packed_linears(child, chosen) if child is not None else None
                for name, child in module._modules.items()}
    if all(children[name] is child for name, child in module._modules.items()):
        return module
    clone = module.__class__.__new__(module.__class__)
    clone.__dict__ = dict(module.__dict__)
    clone._modules = dict(children)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    return clone
