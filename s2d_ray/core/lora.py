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
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
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
    adapter each row of the next forward uses ("" for the base)."""

    def __init__(self, max_loaded: int = 4, max_rank: int = 64) -> None:
        if max_loaded < 1 or max_rank < 1:
            raise ValueError(f"max_loaded and max_rank must be >= 1, got {max_loaded}, {max_rank}")
        self.max_loaded, self.max_rank = max_loaded, max_rank
        self.registered: dict[str, LoraWeights] = {}
        self.generation: dict[str, int] = {}  # name -> registration count: KV keys of a re-registered name differ
        self.slots: OrderedDict[str, int] = OrderedDict()  # resident name -> slot (1..max_loaded), LRU first
        self.stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # module -> A [S, R, in], B [S, out, R]
        self.rows: torch.Tensor | None = None  # slot of each row of the forward under way (None: all base)
        self._registrations = 0

    # --- construction -------------------------------------------------------------------------------------------
    def wrap(self, layers: nn.ModuleList) -> nn.ModuleList:
        """Structural copies of `layers` whose projections read this bank (parameters shared, `layers` untouched)."""
        return nn.ModuleList(self._wrapped(layer, str(i)) for i, layer in enumerate(layers))

    def _wrapped(self, module: nn.Module, path: str) -> nn.Module:
        weight = getattr(module, "weight", None)
        if path.count(".") >= 1 and isinstance(weight, torch.Tensor) and weight.dim() == 2 and not module._modules:
            out_f, in_f = weight.shape
            slots = self.max_loaded + 1
            self.stacks[path] = (weight.new_zeros(slots, self.max_rank, in_f),
                                 weight.new_zeros(slots, out_f, self.max_rank))
            return LoraProjection(module, self, path)
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
            sa, sb = self.stacks[module]
            if a.shape[1] != sa.shape[2] or b.shape[0] != sb.shape[1]:
                raise AdapterError(f"adapter {weights.name}: {module} maps {a.shape[1]} -> {b.shape[0]} features, "
                                   f"this base's {sa.shape[2]} -> {sb.shape[1]} (an adapter of another base)")
        dtype = next(iter(self.stacks.values()))[0].dtype
        cast = {m: (a.to(dtype), b.to(dtype)) for m, (a, b) in weights.factors.items()}
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
    """A projection plus each row's adapter: base(x) + (x @ A[slot].T) @ B[slot].T, slot gathered per row."""

    def __init__(self, base: nn.Module, bank: LoraBank, path: str) -> None:
        super().__init__()
        self.base, self.path = base, path
        self._bank = [bank]  # not a submodule: the bank is shared by every projection

    @property
    def weight(self) -> torch.Tensor:  # what code reading a projection's shape (head counts) looks at
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = self._bank[0].rows
        if rows is None:
            return y
        if x.dim() != 3 or x.shape[0] != rows.shape[0]:
            raise ValueError(f"{self.path}: input {tuple(x.shape)} is not [rows={rows.shape[0]}, positions, features]")
        stack_a, stack_b = self._bank[0].stacks[self.path]
        a, b = stack_a.index_select(0, rows), stack_b.index_select(0, rows)  # [n, R, in], [n, out, R]
        return y + torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2))
