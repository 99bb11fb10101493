"""Per-row LoRA: one base model's verification forward serves rows of many adapters at once.

Each adapted projection computes base(x) + B_a(A_a(x)) * scale_a with `a` the adapter of x's row. The resident
adapters' A and B are stacked per projection, zero-padded to one rank (zero rows and columns add nothing, so a
smaller rank stays exact), with slot 0 all zeros for rows of the base model; a forward gathers each row's slot
(`index_select`) and runs two batched matmuls (`torch.bmm`), whatever mix of adapters the rows hold. The scale is
folded into B when an adapter is read.

Adapters come in peft's format (`from_peft`; models/adapters.py reads the directory): plain LoRA on decoder-layer
projections. What this cannot reproduce (DoRA, bias training, modules_to_save, embedding or LM-head adapters) is
refused when the adapter is read, never applied in part.

KV computed under one adapter is kept apart from every other's: `LoraBank.key` names an adapter's registration, and
the verifier shares prefixes (forks, the prefix cache) only between rows of the same key.

On a tensor-parallel rank each projection holds a shard, and its adapters are cut the same way (`Split`, given by the
serving layer as plain slices): a column-parallel projection (its output features split) keeps its rows of B with A
whole; a row-parallel one (its input features split, partial outputs summed over the ranks) keeps its columns of A
with B whole, and adds its partial delta to its partial output before the sum. The delta is linear in x, so the sum
over the ranks is the whole adapter's delta, with no collective of its own.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .errors import ModelLoadError

# peft's state-dict key of a decoder-layer LoRA factor: ...layers.<i>.<module path>.lora_<A|B>.weight
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


class AdapterError(ModelLoadError):
    """An adapter that cannot serve on this base: missing files, an unsupported kind, wrong shapes or rank."""


@dataclass(frozen=True)
class LoraWeights:
    """One adapter, parsed: per projection ("<layer>.<path in layer>", e.g. "3.self_attn.q_proj") A [r, in] and
    B [out, r] with the scale folded into B."""

    name: str
    rank: int
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.factors.values())


@dataclass(frozen=True)
class Split:
    """How a tensor-parallel rank holds one projection, which its adapters' factors mirror. `full`: (out, in)
    features of the whole projection, what an adapter is checked against. `out`: the output features this rank keeps
    (column-parallel: B's rows cut alike, A whole). `in_`: the input features it holds (row-parallel: A's columns cut
    alike, B whole); `reduce` then sums a tensor over the group in place, and the projection is weight, sum, bias in
    that order, so the rank's partial delta joins its partial output before the sum."""

    full: tuple[int, int]
    out: slice | None = None
    in_: slice | None = None
    reduce: Callable[[torch.Tensor], object] | None = None

    def __post_init__(self) -> None:
        if self.out is not None and self.in_ is not None:
            raise ValueError("a projection is split along its output or its input features, not both")
        if (self.in_ is None) != (self.reduce is None):
            raise ValueError("a row-parallel split (in_) needs the group's sum (reduce), and only it has one")

    def cut(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's A and B of a whole adapter's factors (copies: the whole tensors are not kept)."""
        if self.out is not None:
            b = b[self.out]
        if self.in_ is not None:
            a = a[:, self.in_]
        return a.clone(memory_format=torch.contiguous_format), b.clone(memory_format=torch.contiguous_format)

    def held(self) -> tuple[int, int]:
        """(out, in) features of the rank's shard."""
        out, inp = self.full
        return (_length(self.out, out), _length(self.in_, inp))


def _length(cut: slice | None, size: int) -> int:
    return size if cut is None else len(range(*cut.indices(size)))


_REFUSED = {  # peft options this module cannot reproduce, and what a config must say to pass
    "use_dora": False, "lora_bias": False, "bias": "none", "modules_to_save": None, "target_parameters": None,
    "fan_in_fan_out": False,
}


def from_peft(name: str, cfg: dict, state: dict[str, torch.Tensor]) -> LoraWeights:
    """An adapter from peft's adapter_config.json (`cfg`) and state dict (models/adapters.py reads the files)."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name}: peft_type {cfg.get('peft_type')!r} is not LoRA")
    for key, allowed in _REFUSED.items():
        if cfg.get(key, allowed) not in (allowed, [], {}):
            raise AdapterError(f"adapter {name}: {key}={cfg[key]!r} is not supported (plain LoRA on decoder-layer "
                               "projections only)")
    rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(f"adapter {name}: weight {key!r} is not a LoRA factor of a decoder-layer projection "
                               "(embedding, LM-head and modules_to_save adapters are not supported)")
        halves.setdefault(f"{m.group(1)}.{m.group(2)}", {})[m.group(3)] = (
            tensor if tensor.dtype == torch.float64 else tensor.float())  # the scale is folded in at full width
    factors = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter {name}: {module} has lora_{next(iter(pair))} without its other factor")
        a, b = pair["A"], pair["B"]
        r = a.shape[0]
        if b.shape[1] != r:
            raise AdapterError(f"adapter {name}: {module} has A of rank {r} but B of rank {b.shape[1]}")
        short = module.split(".")[-1]
        mod_alpha = float(alpha_pattern.get(short, alpha))
        expected_rank = int(rank_pattern.get(short, rank))
        if r != expected_rank:
            raise AdapterError(f"adapter {name}: {module} has rank {r}, its config says {expected_rank}")
        scale = mod_alpha / math.sqrt(r) if cfg.get("use_rslora") else mod_alpha / r
        factors[module] = (a, b * scale)
    if not factors:
        raise AdapterError(f"adapter {name}: holds no LoRA weights")
    return LoraWeights(name, max(a.shape[0] for a, _ in factors.values()), factors)


class LoraBank:
    """The adapters a verifier serves: registered ones (their low-rank weights, any number) and up to `max_loaded`
    resident in the stacked slots a forward reads, least recently used evicted first (a row naming an evicted
    adapter loads it back into a slot before its forward).

    `wrap(layers)` puts a `LoraProjection` around every Linear of the decoder layers; `bind(names)` says which
    adapter each row of the next forward uses ("" for the base). `splits`: on a tensor-parallel rank, how each split
    projection ("<layer>.<path in layer>", as in LoraWeights.factors) is held; projections not named are whole."""

    def __init__(self, max_loaded: int = 4, max_rank: int = 64, splits: Mapping[str, Split] | None = None) -> None:
        if max_loaded < 1 or max_rank < 1:
            raise ValueError(f"max_loaded and max_rank must be >= 1, got {max_loaded}, {max_rank}")
        self.max_loaded, self.max_rank = max_loaded, max_rank
        self.splits: dict[str, Split] = dict(splits or {})
        self.full: dict[str, tuple[int, int]] = {}  # module -> (out, in) features of the whole projection
        self.registered: dict[str, LoraWeights] = {}
        self.generation: dict[str, int] = {}  # name -> registration count: KV keys of a re-registered name differ
        self.slots: OrderedDict[str, int] = OrderedDict()  # resident name -> slot (1..max_loaded), LRU first
        self.stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # module -> A [S, R, in], B [S, out, R]
        self.rows: torch.Tensor | None = None  # slot of each row of the forward under way (None: all base)
        self._registrations = 0

    # --- construction -------------------------------------------------------------------------------------------
    def wrap(self, layers: nn.ModuleList) -> nn.ModuleList:
        """Structural copies of `layers` whose projections read this bank (parameters shared, `layers` untouched)."""
        wrapped = nn.ModuleList(self._wrapped(layer, str(i)) for i, layer in enumerate(layers))
        unknown = sorted(set(self.splits) - set(self.stacks))
        if unknown:
            raise ValueError(f"splits name projections these layers do not have: {unknown[:5]}")
        return wrapped

    def _wrapped(self, module: nn.Module, path: str) -> nn.Module:
        weight = getattr(module, "weight", None)
        if path.count(".") >= 1 and isinstance(weight, torch.Tensor) and weight.dim() == 2 and not module._modules:
            out_f, in_f = weight.shape
            split = self.splits.get(path)
            if split is not None and split.held() != (out_f, in_f):
                raise ValueError(f"{path}: its split holds {split.held()} of {split.full} features, its weight is "
                                 f"{(out_f, in_f)}")
            self.full[path] = split.full if split is not None else (out_f, in_f)
            slots = self.max_loaded + 1
            self.stacks[path] = (weight.new_zeros(slots, self.max_rank, in_f),
                                 weight.new_zeros(slots, out_f, self.max_rank))
            return LoraProjection(module, self, path, split)
        children = {n: self._wrapped(c, f"{path}.{n}") if c is not None else None for n, c in module._modules.items()}
        if all(children[n] is c for n, c in module._modules.items()):
            return module
        clone = module.__class__.__new__(module.__class__)
        clone.__dict__ = dict(module.__dict__)
        clone._modules, clone._parameters, clone._buffers = children, dict(module._parameters), dict(module._buffers)
        return clone

    # --- adapters -----------------------------------------------------------------------------------------------
    def register(self, weights: LoraWeights) -> None:
        """Make an adapter servable under weights.name (replacing one of that name), after checking it fits this
        base: every module it adapts exists here with the shapes it expects, its rank within max_rank."""
        if not self.stacks:
            raise AdapterError("this verifier has no adapted projections (wrap the layers first)")
        if weights.rank > self.max_rank:
            raise AdapterError(f"adapter {weights.name}: rank {weights.rank} exceeds this target's max_rank "
                               f"{self.max_rank}")
        for module, (a, b) in weights.factors.items():
            if module not in self.stacks:
                raise AdapterError(f"adapter {weights.name}: adapts {module}, which this base model does not have "
                                   "(an adapter of another base?)")
            out_f, in_f = self.full[module]
            if a.shape[1] != in_f or b.shape[0] != out_f:
                raise AdapterError(f"adapter {weights.name}: {module} maps {a.shape[1]} -> {b.shape[0]} features, "
                                   f"this base's {in_f} -> {out_f} (an adapter of another base)")
        dtype = next(iter(self.stacks.values()))[0].dtype
        cast = {}
        for m, (a, b) in weights.factors.items():  # on a tensor-parallel rank: its shard of each factor
            split = self.splits.get(m)
            a, b = split.cut(a, b) if split is not None else (a, b)
            cast[m] = (a.to(dtype), b.to(dtype))
        self.unregister(weights.name)
        self._registrations += 1
        self.registered[weights.name] = LoraWeights(weights.name, weights.rank, cast)
        self.generation[weights.name] = self._registrations

    def unregister(self, name: str) -> bool:
        """Forget an adapter (its slot freed); False if it was not registered."""
        if name not in self.registered:
            return False
        del self.registered[name], self.generation[name]
        slot = self.slots.pop(name, None)
        if slot is not None:
            self._fill(slot, None)
        return True

    def key(self, name: str) -> str:
        """Whose KV a row of adapter `name` computes: the base's "" or the adapter's current registration."""
        if not name:
            return ""
        if name not in self.registered:
            raise KeyError(name)
        return f"{name}#{self.generation[name]}"

    # --- forwards -----------------------------------------------------------------------------------------------
    def bind(self, names: list[str], device: torch.device) -> None:
        """Slots for the next forward's rows (names[i]: row i's adapter, "" the base), loading evicted adapters.

        More distinct adapters in one forward than there are slots is refused: callers split such batches."""
        wanted = list(dict.fromkeys(n for n in names if n))
        unknown = [n for n in wanted if n not in self.registered]
        if unknown:
            raise KeyError(f"adapter(s) {unknown} are not loaded here")
        if len(wanted) > self.max_loaded:
            raise ValueError(f"{len(wanted)} adapters in one forward; this target keeps at most {self.max_loaded} "
                             "resident (lora.max_loaded)")
        for name in wanted:
            if name in self.slots:
                self.slots.move_to_end(name)
            else:
                self._load(name, set(wanted))
        if not wanted:
            self.rows = None
            return
        self.rows = torch.tensor([self.slots[n] if n else 0 for n in names], device=device)

    def unbind(self) -> None:
        self.rows = None

    def _load(self, name: str, keep: set[str]) -> None:
        used = set(self.slots.values())
        free = [s for s in range(1, self.max_loaded + 1) if s not in used]
        if free:
            slot = free[0]
        else:  # the least recently used adapter this forward does not need gives its slot up
            victim = next(n for n in self.slots if n not in keep)
            slot = self.slots.pop(victim)
        self._fill(slot, self.registered[name])
        self.slots[name] = slot

    @torch.no_grad()
    def _fill(self, slot: int, weights: LoraWeights | None) -> None:
        for module, (sa, sb) in self.stacks.items():
            sa[slot].zero_()
            sb[slot].zero_()
            if weights is not None and module in weights.factors:
                a, b = weights.factors[module]
                sa[slot, : a.shape[0]].copy_(a)
                sb[slot, :, : b.shape[1]].copy_(b)

    def resident_bytes(self) -> int:
        """Memory the stacked slots take (every slot, filled or not)."""
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.stacks.values())

    def stats(self) -> dict:
        return {"registered": sorted(self.registered), "resident": list(self.slots), "max_loaded": self.max_loaded,
                "max_rank": self.max_rank, "resident_bytes": self.resident_bytes()}


class LoraProjection(nn.Module):
    """A projection plus each row's adapter: base(x) + (x @ A[slot].T) @ B[slot].T, slot gathered per row. A
    row-parallel shard (`split.reduce`) adds its partial delta before the group's sum, not after it."""

    def __init__(self, base: nn.Module, bank: LoraBank, path: str, split: Split | None = None) -> None:
        super().__init__()
        self.base, self.path = base, path
        self.reduce = split.reduce if split is not None else None
        self._bank = [bank]  # not a submodule: the bank is shared by every projection

    @property
    def weight(self) -> torch.Tensor:  # what code reading a projection's shape (head counts) looks at
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._bank[0].rows
        if rows is None:
            return self.base(x)
        if x.dim() != 3 or x.shape[0] != rows.shape[0]:
            raise ValueError(f"{self.path}: input {tuple(x.shape)} is not [rows={rows.shape[0]}, positions, features]")
        if self.reduce is None:
            return self.base(x) + self.delta(x, rows)
        # Row-parallel shard: weight, sum, bias as its own forward, with this rank's partial delta inside the sum.
        out = torch.matmul(x, self.base.weight.transpose(-1, -2))
        out += self.delta(x, rows)
        self.reduce(out)
        bias = getattr(self.base, "bias", None)
        return out if bias is None else out + bias

    def delta(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """(x @ A[slot].T) @ B[slot].T per row: the rank's share where the projection is split."""
        stack_a, stack_b = self._bank[0].stacks[self.path]
        a, b = stack_a.index_select(0, rows), stack_b.index_select(0, rows)  # [n, R, in], [n, out, R]
        return torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2))
