"""CPU projections on weights packed once, where that measured faster on this CPU: oneDNN for several rows, MKL's
packed GEMM for one row.

Why several rows: verification and batched decoding push 2-32 rows through every projection. On an AVX2 CPU in fp32
torch's stock kernel (MKL's GEMM) repacks the weight on every call and costs several times a single row's GEMV
already at 2-3 rows, so verifying a second position cost more than a decode step and no draft could pay for it.
oneDNN's linear with a weight reordered once (`torch.ops.mkldnn._reorder_linear_weight`, what torch inductor's CPU
weight prepacking calls) runs a few rows for about one row's time on the large shapes (the MLP, the LM head), and
loses on small ones (k/v).

Why one row: a decode step (plain rounds, `ar`, every draft step) is one row per sequence. MKL's GEMM on a weight
packed for exactly one row (`torch.ops.mkl._mkl_reorder_linear_weight(w, 1)`) runs the LM head and the MLP's
up/gate faster than the stock GEMV on AVX2 hosts; fp32 only. Its packed copy is larger than the weight (about 2x for
the head, more for the MLP's), so a shape takes it only where it measured faster AND the copy is at most
ONE_ROW_MAX_COPY times the weight's bytes. Other row counts on that copy fall back to the stock kernel inside MKL, so
the several-row choice above is independent.

Each choice is measured per weight shape, dtype and thread count when a stack asks for it (`packed_is_faster`,
`one_row_is_faster`), against the least time each candidate ever took on this machine (kernels/timing_store.py: a
process that loads beside busy neighbours keeps a quiet process's choice). Rounding differs from the stock kernel by
~1e-6 relative (the stock kernel is not batch-invariant either); fp64 is never packed.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from .timing_store import TimingStore, least_times

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


ONE_ROW_MAX_COPY = 2.5  # the one-row copy's bytes over the weight's: the LM head's copy passes, the MLP's does not


@functools.lru_cache(maxsize=None)
def one_row_supported(dtype: torch.dtype) -> bool:
    """Whether MKL's one-row packed GEMM runs here for this dtype (fp32 only, with MKL)."""
    if not (dtype == torch.float32 and torch.backends.mkl.is_available() and hasattr(torch.ops, "mkl")
            and hasattr(torch.ops.mkl, "_mkl_linear")):
        return False
    try:
        w = torch.ones(4, 8, dtype=dtype)
        _one_row_linear(torch.ones(1, 8, dtype=dtype), _pack_one_row(w), w, None)
    except RuntimeError:
        return False
    return True


def _pack_one_row(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), 1)


def _one_row_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkl._mkl_linear(x, packed, weight.detach(), bias, 1)


def _timing_weights(out_features: int, in_features: int, dtype: torch.dtype, pack) -> tuple[list, list]:
    """Random weights of one shape, ~32 MB of them (so a timed loop does not run from cache), and their packed
    copies."""
    count = max(1, min(24, (32 << 20) // (out_features * in_features * torch.finfo(dtype).bits // 8)))
    weights = [torch.randn(out_features, in_features).to(dtype) for _ in range(count)]
    return weights, [pack(w) for w in weights]


@functools.lru_cache(maxsize=None)
def one_row_is_faster(out_features: int, in_features: int, dtype: torch.dtype, threads: int,
                      store: TimingStore | None = None, repeats: int = 5) -> bool:
    """Whether MKL's one-row packed GEMM beats the stock kernel at one row for this weight shape (best of `repeats`,
    alternated, several weights so they do not all sit in cache) with a copy at most ONE_ROW_MAX_COPY times the
    weight. Once per process, shape, dtype and thread count."""
    if not one_row_supported(dtype):
        return False
    try:
        probe = torch.randn(out_features, in_features).to(dtype)  # the cap first: no timing set for a shape over it
        if _pack_one_row(probe).numel() > ONE_ROW_MAX_COPY * probe.numel():
            return False
        weights, packed = _timing_weights(out_features, in_features, dtype, _pack_one_row)
        x = torch.randn(1, in_features).to(dtype)
        best = {False: float("inf"), True: float("inf")}
        with torch.no_grad():
            for _ in range(repeats):
                for use_packed in (False, True):
                    t0 = time.perf_counter()
                    for w, p in zip(weights, packed):
                        _one_row_linear(x, p, w, None) if use_packed else F.linear(x, w)
                    best[use_packed] = min(best[use_packed], time.perf_counter() - t0)
    except RuntimeError as exc:
        logger.debug("one-row packed linear unavailable for %s: %s", dtype, exc)
        return False
    t = least_times(store, f"linear one-row {out_features}x{in_features} {dtype} t{threads}",
                    {"stock": best[False], "packed": best[True]})
    logger.debug("linear %dx%d %s one row: stock %.3f ms, packed %.3f ms (least seen: %.3f, %.3f)", out_features,
                 in_features, dtype, best[False] * 1e3, best[True] * 1e3, t["stock"] * 1e3, t["packed"] * 1e3)
    return t["packed"] < MIN_GAIN * t["stock"]


@functools.lru_cache(maxsize=None)
def packed_is_faster(out_features: int, in_features: int, dtype: torch.dtype, threads: int,
                     store: TimingStore | None = None, repeats: int = 5) -> bool:
    """Whether the packed kernel beats the stock one for this weight shape and dtype on this CPU at 2, 4 and 8 rows
    (summed; best of `repeats`, alternated; several weights so that they do not all sit in cache). Once per process,
    shape, dtype, thread count and store; most of the time goes to the LM head."""
    if not supported(dtype):
        return False
    try:
        weights, packed = _timing_weights(out_features, in_features, dtype, _pack)
        inputs = {m: torch.randn(m, in_features).to(dtype) for m in TIMED_ROWS}
        best = {False: dict.fromkeys(TIMED_ROWS, float("inf")), True: dict.fromkeys(TIMED_ROWS, float("inf"))}
        if out_features * in_features > (4 << 20):
            repeats = min(repeats, 3)  # the LM head: the dearest call to time, and its choice is never close
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
    t = least_times(store, several_key(out_features, in_features, dtype, threads),
                    {"stock": sum(best[False].values()), "packed": sum(best[True].values())})
    logger.debug("linear %dx%d %s: stock %.2f ms, packed %.2f ms (rows %s; least seen on this machine)", out_features,
                 in_features, dtype, t["stock"] * 1e3, t["packed"] * 1e3, TIMED_ROWS)
    return t["packed"] < MIN_GAIN * t["stock"]


def several_key(out_features: int, in_features: int, dtype: torch.dtype, threads: int) -> str:
    """packed_is_faster's entry in the machine's kernel times (kernels/timing_store.py)."""
    return f"linear several {out_features}x{in_features} {dtype} t{threads} rows{','.join(map(str, TIMED_ROWS))}"


class PackedLinear(nn.Module):
    """A Linear with packed copies of its weight: several-row calls run oneDNN on one (`several`), one-row calls MKL's
    one-row GEMM on the other (`one_row`); anything not enabled, autograd and non-CPU inputs run the stock kernel.
    The weight and bias are the original Parameters (shared, same state-dict keys); the packed copies follow them:
    each is remade when the weight changes (in-place updates bump its version)."""

    def __init__(self, weight: nn.Parameter | torch.Tensor, bias: nn.Parameter | torch.Tensor | None = None,
                 several: bool = True, one_row: bool = False) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.several, self.one_row = several, one_row
        self._copies: dict[str, tuple[tuple, torch.Tensor]] = {}

    def _copy(self, kind: str) -> torch.Tensor:
        w = self.weight
        key = (w.data_ptr(), w._version, w.dtype)
        held = self._copies.get(kind)
        if held is None or held[0] != key:
            held = (key, _pack(w) if kind == "several" else _pack_one_row(w))
            self._copies[kind] = held
        return held[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        stock = (rows == 0 or not (self.one_row if rows == 1 else self.several) or x.device.type != "cpu"
                 or self.weight.device.type != "cpu" or torch.is_grad_enabled() and self.weight.requires_grad)
        if stock:
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        if rows == 1:
            return _one_row_linear(x, self._copy("one_row"), self.weight, bias)
        return _packed_linear(x, self._copy("several"), bias)

    def extra_repr(self) -> str:
        kinds = [k for k in ("several", "one_row") if getattr(self, k)]
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for {'+'.join(kinds)}"


# One PackedLinear per original Linear (a target's first layers also serve a cut draft: packed once).
_WRAPPED: weakref.WeakKeyDictionary[nn.Linear, PackedLinear] = weakref.WeakKeyDictionary()


def packed(linear: nn.Linear, several: bool = True, one_row: bool = False) -> PackedLinear:
    """The one PackedLinear of `linear`, with the kernels asked for enabled (added to any enabled before)."""
    if linear not in _WRAPPED:
        _WRAPPED[linear] = PackedLinear(linear.weight, linear.bias, several, one_row)
    wrapped = _WRAPPED[linear]
    wrapped.several, wrapped.one_row = wrapped.several or several, wrapped.one_row or one_row
    return wrapped


def with_packed_linears(module: nn.Module, chosen) -> nn.Module:
    """A structural copy of `module` whose Linear children `chosen(linear)` -> (several, one_row) packs for either are
    PackedLinear (`with_linears`)."""
    def wrap(linear: nn.Linear) -> nn.Module:
        several, one_row = chosen(linear)
        return packed(linear, several, one_row) if several or one_row else linear

    return with_linears(module, wrap)


def with_linears(module: nn.Module, wrap) -> nn.Module:
    """A structural copy of `module` whose Linear children are `wrap(linear)`; every parameter, buffer and untouched
    submodule is shared with the original, which is left as it was (a Hugging Face model's own forward and `generate`
    keep the stock kernels)."""
    if type(module) is nn.Linear:
        return wrap(module)
    children = {name: with_linears(child, wrap) if child is not None else None
                for name, child in module._modules.items()}
    if all(children[name] is child for name, child in module._modules.items()):
        return module
    clone = module.__class__.__new__(module.__class__)
    clone.__dict__ = dict(module.__dict__)
    clone._modules = dict(children)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    return clone
