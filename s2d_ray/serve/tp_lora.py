"""LoRA on a tensor-parallel rank: how each of its projections is split, read off the loaded shard, as core/lora.py's
`Split`s (plain slices and the group's sum), so each rank keeps its cut of every adapter.

A rank's model comes one of two ways (serve/tp.py): read as a shard (models/shards.py: q/k/v/gate/up keep an even
share of their output features, o/down are RowParallelLinear over their input features), or cut by DeepSpeed AutoTP
(LinearLayer: output features; LinearAllreduce: input features, the partial outputs summed by RowParallel). AutoTP's
shares need not be even (whole heads, `tp_grain_size` for MLPs): the slices come from each layer's own partition
sizes. A DeepSpeed layer of another kind (fused QKV, packed gate/up, a gathered output) is refused: LoRA would need
another cut there.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ..core.decoder import decoder_parts
from ..core.lora import LoraBank, Split
from ..models.shards import COLUMN, RowParallelLinear, shard_slice
from .lora import register_adapter


def lora_splits(model: nn.Module, loading: str, rank: int, world: int) -> dict[str, Split]:
    """The split projections of the rank's decoder layers, named as LoraBank names them ("<layer>.<path>");
    `loading`: "shard" (models/shards.py) or "whole" (DeepSpeed AutoTP cut the model)."""
    splits: dict[str, Split] = {}
    for i, layer in enumerate(decoder_parts(model).layers):
        for path, module in layer.named_modules():
            weight = getattr(module, "weight", None)
            if not path or module._modules or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
                continue
            split = (_deepspeed_split(module, path) if loading == "whole"
                     else _shard_split(module, path, rank, world))
            if split is not None:
                splits[f"{i}.{path}"] = split
    return splits


def _shard_split(module: nn.Module, path: str, rank: int, world: int) -> Split | None:
    """models/shards.py's even split: column projections by name, row ones by their class."""
    out_f, in_f = module.weight.shape
    if isinstance(module, RowParallelLinear):
        return Split((out_f, in_f * world), in_=shard_slice(in_f * world, rank, world, path),
                     reduce=module.all_reduce)
    if path.rsplit(".", 1)[-1] in COLUMN:
        return Split((out_f * world, in_f), out=shard_slice(out_f * world, rank, world, path))
    return None


def _deepspeed_split(module: nn.Module, path: str) -> Split | None:
    """AutoTP's split of one layer, from its partition sizes and its index in the group; None for a Linear it kept
    whole on every rank."""
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer, TensorParallel_Layer

    kind = type(module)
    gathered = kind is LinearLayer and module.gather_output  # its output whole again, its weight still a shard
    if kind not in (LinearLayer, LinearAllreduce) or gathered:
        if isinstance(module, TensorParallel_Layer):
            raise ValueError(f"{path}: DeepSpeed AutoTP made it a {kind.__name__}"
                             f"{' gathering its output' if gathered else ''}, which LoRA does not mirror; adapters are "
                             "served on LinearLayer (split output) and LinearAllreduce shards only")
        return None
    sizes, index = module._partition_sizes, module.tp_index
    held = slice(sum(sizes[:index]), sum(sizes[: index + 1]))
    out_f, in_f = module.weight.shape
    if kind is LinearLayer:
        return Split((sum(sizes), in_f), out=held)
    return Split((out_f, sum(sizes)), in_=held, reduce=partial(_deepspeed_sum, module))


def _deepspeed_sum(module: nn.Module, out: torch.Tensor) -> None:
    """LinearAllreduce's own sum over its group (in place), as its forward does it."""
    from deepspeed.module_inject.layers import RowParallel

    RowParallel.apply(module.mp_group, out, not module.is_training_mode())


def rank_bank(spec, model: nn.Module, loading: str, rank: int, world: int) -> LoraBank | None:
    """The rank's LoraBank for a target with `lora:` (None without), its adapters cut as its projections are."""
    if spec is None or spec.lora is None:
        return None
    return LoraBank(spec.lora.max_loaded, spec.lora.max_rank, lora_splits(model, loading, rank, world))


def register_on_rank(bank: LoraBank | None, name: str, where: str) -> dict:
    """serve/lora.py's register_adapter, with any other exception as a refusal too: a rank answers, never raises,
    so the group can compare its ranks' answers (`group_adapter_answer`)."""
    try:
        return register_adapter(bank, name, where)
    except Exception as exc:  # noqa: BLE001 - reported to the caller, and the load undone on every rank
        return {"error": f"adapter {name}: {type(exc).__name__}: {exc}"}


def group_adapter_answer(answers: list[dict]) -> tuple[dict, bool]:
    """(the group's answer to a load, whether to undo it on every rank): loaded where every rank loaded it; else the
    first refusal, undone where only some ranks refused (the ranks must hold the same adapters)."""
    errors = [a["error"] for a in answers if "error" in a]
    if not errors:
        return answers[0], False
    return {"error": errors[0]}, len(errors) < len(answers)
