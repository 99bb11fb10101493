"""Tensor-parallel shards loaded as shards: a rank builds the model on the meta device and reads only its slices of
the checkpoint (safetensors `get_slice`), so a group of N ranks holds about one model in host memory, not N.

The split is Megatron's, as DeepSpeed AutoTP applies it to Llama-like layers: q/k/v and gate/up projections keep
their rank's output features (whole heads), o and down projections their input features, and the outputs of the
latter are summed over the ranks (`all_reduce`); embeddings, norms and the LM head stay whole on every rank.
"""

from __future__ import annotations

import json
import logging
import resource
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import ConfigError, ModelLoadError

logger = logging.getLogger(__name__)

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output features split across ranks
ROW = ("o_proj", "down_proj")  # input features split; the rank's partial outputs are summed
AllReduce = Callable[[torch.Tensor], None]  # sums a tensor over the group, in place


class RowParallelLinear(nn.Module):
    """A Linear holding the rank's slice of the input features: y = all_reduce(x_rank @ W_rank^T) + b."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, all_reduce: AllReduce) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        self.all_reduce(out)
        return out if self.bias is None else out + self.bias


def shard_rule(name: str) -> int | None:
    """The dimension a checkpoint tensor is split along (0: output features, 1: input features), None: whole."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-1] == "weight":
        if parts[-2] in COLUMN:
            return 0
        if parts[-2] in ROW:
            return 1
    if len(parts) >= 2 and parts[-1] == "bias" and parts[-2] in COLUMN:
        return 0
    return None


def shard_slice(size: int, rank: int, world: int, name: str) -> slice:
    """Rank's contiguous share of `size` features; sizes that do not divide evenly would cut a head apart."""
    if size % world:
        raise ConfigError(f"{name}: {size} features do not split evenly over tp_size {world}; choose a tp_size that "
                          "divides the model's key/value heads")
    step = size // world
    return slice(rank * step, (rank + 1) * step)


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors files of a Hugging Face directory (sharded through its index, or one file)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / n for n in names]
    return sorted(directory.glob("*.safetensors"))


def read_shard(directory: Path, rank: int, world: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The rank's tensors: only its slice of each split weight is copied out of the file (safe_open's get_slice).
    The file is mapped anew per tensor: a mapping's pages count in the process's memory while it is open, and a
    slice across input features reads pages of the whole tensor. Each slice is copied (its own memory, not a view of
    the mapping), so nothing keeps the file mapped once loading ends."""
    from safetensors import safe_open

    files = checkpoint_files(directory)
    if not files:
        raise ModelLoadError(f"{directory} holds no safetensors files: shard-only loading needs them")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names = list(f.keys())
        for name in names:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                out[name] = _rank_slice(f.get_slice(name), name, rank, world).to(dtype, copy=True)
    return out


def _rank_slice(part, name: str, rank: int, world: int) -> torch.Tensor:
    dim = shard_rule(name)
    if dim is None:
        return part[:]
    if dim == 0:
        return part[shard_slice(part.get_shape()[0], rank, world, name)]
    return part[:, shard_slice(part.get_shape()[1], rank, world, name)]


def load_sharded(directory: Path, rank: int, world: int, dtype: torch.dtype, all_reduce: AllReduce,
                 trust_remote_code: bool = False) -> nn.Module:
    """The causal LM of `directory` holding only rank `rank` of `world`'s shard: built on the meta device, every
    parameter then set from the rank's slices; o/down projections become RowParallelLinear over `all_reduce`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory, local_files_only=True, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    tensors = read_shard(directory, rank, world, dtype)
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if name not in tensors:
            continue
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if isinstance(module, nn.Linear) and owner.rsplit(".", 1)[-1] in ROW and leaf == "weight":
            bias = tensors.get(f"{owner}.bias")
            model.set_submodule(owner, RowParallelLinear(tensors[name], bias, all_reduce))
        elif not (leaf == "bias" and owner.rsplit(".", 1)[-1] in ROW):
            setattr(module, leaf, nn.Parameter(tensors[name], requires_grad=False))
    if getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in tensors:
        model.lm_head.weight = model.get_input_embeddings().weight
    _materialize_buffers(model, config)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelLoadError(f"{directory}: the checkpoint has no tensors for {missing[:5]}; shard-only loading "
                             "knows Hugging Face names of Llama-like models")
    model.eval()
    model.requires_grad_(False)
    return model


def _materialize_buffers(model: nn.Module, config) -> None:
    """Buffers computed at construction (rotary inverse frequencies) are empty on the meta device: made again."""
    for name, module in model.named_modules():
        if any(b.is_meta for b in module.buffers(recurse=False)):
            if not hasattr(module, "rope_type") and "rotary" not in name:
                raise ModelLoadError(f"cannot rebuild buffers of {name} ({type(module).__name__}) off the meta device")
            model.set_submodule(name, type(module)(config=config))  # built outside the meta context: on the CPU


def reset_peak_rss() -> None:
    """Start measuring the peak resident memory afresh (Linux: clear_refs 5 resets VmHWM), so the peak a rank reports
    is its loading's, not the imports' before it. Elsewhere the peak keeps counting from the start."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_bytes() -> int:
    """This process's peak resident memory since the last reset_peak_rss (what a rank's loading cost the host)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
