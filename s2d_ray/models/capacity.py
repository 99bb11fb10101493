"""How many KV rows a replica can hold: a memory budget (a share of the device's memory, or of host RAM on the CPU)
less the weights, divided by what one full-length row costs for the model's shapes.

    row bytes  = max_slots x 2 x layers x kv_heads / tp_size x head_dim x dtype_bytes
    rows       = min(max_live_sequences, (budget - weights) // row bytes)      (at least 1, else a deploy error)

No torch import at module level: the serving config sizes targets at build time, before any model loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, ModelLoadError

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """What KV and weight sizes depend on, read from a Hugging Face config (Llama-like families)."""

    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    heads: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ModelShape":
        cfg = config.get("text_config", config)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(layers=int(cfg["num_hidden_layers"]), kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or hidden // heads), hidden=hidden,
                   intermediate=int(cfg["intermediate_size"]), heads=heads, vocab=int(cfg["vocab_size"]),
                   tied=bool(cfg.get("tie_word_embeddings", False)))

    def kv_bytes_per_token(self, dtype: str, tp_size: int = 1) -> int:
        """K and V of one position in every layer (a TP rank holds kv_heads / tp_size of the heads)."""
        return 2 * self.layers * max(1, self.kv_heads // tp_size) * self.head_dim * DTYPE_BYTES[dtype]

    def weight_bytes(self, dtype: str, tp_size: int = 1) -> int:
        """The weights one replica (or TP rank: its share of the layers' projections) holds."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        per_layer = (attn + 3 * self.hidden * self.intermediate) // tp_size + 2 * self.hidden
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return (self.layers * per_layer + embed + self.hidden) * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class Capacity:
    """A replica's KV sizing: `rows` sequences of `slots` positions each within `budget_bytes`."""

    rows: int
    slots: int
    budget_bytes: int
    weight_bytes: int
    row_bytes: int

    def describe(self) -> str:
        return (f"{self.rows} rows x {self.slots} slots ({self.rows * self.row_bytes / GIB:.2f} GiB KV) in a budget "
                f"of {self.budget_bytes / GIB:.2f} GiB less {self.weight_bytes / GIB:.2f} GiB of weights")


def kv_capacity(budget_bytes: int, weight_bytes: int, token_bytes: int, max_slots: int, max_rows: int,
                what: str = "target") -> Capacity:
    """Rows of `max_slots` positions that fit in the budget after the weights, at most `max_rows`; a budget without
    room for one full-length row is a configuration error naming the fields to change."""
    row_bytes = max_slots * token_bytes
    fit = (budget_bytes - weight_bytes) // row_bytes
    if fit < 1:
        raise ConfigError(
            f"{what}: memory budget {budget_bytes / GIB:.2f} GiB less {weight_bytes / GIB:.2f} GiB of weights leaves "
            f"no room for one row of {max_slots} tokens ({row_bytes / GIB:.3f} GiB of KV); fix: raise "
            "memory_fraction, lower limits.max_total_tokens, or use a device with more memory")
    return Capacity(min(max_rows, int(fit)), max_slots, budget_bytes, weight_bytes, row_bytes)


def check_prefix_budget(max_tokens: int, budget_bytes: int, weight_bytes: int, token_bytes: int,
                        what: str = "target") -> None:
    """The prefix cache's token budget must fit in the memory left after the weights: kept rows are KV like live
    ones, so a budget past that would be a promise the replica cannot keep (a configuration error at deploy)."""
    fit = max(0, (budget_bytes - weight_bytes) // token_bytes)
    if max_tokens > fit:
        raise ConfigError(
            f"prefix_cache.max_tokens: {max_tokens} tokens of KV ({max_tokens * token_bytes / GIB:.2f} GiB) do not "
            f"fit {what}'s memory budget {budget_bytes / GIB:.2f} GiB less {weight_bytes / GIB:.2f} GiB of weights "
            f"(at most {fit} tokens); fix: lower prefix_cache.max_tokens or raise memory_fraction")


def host_memory_bytes() -> int:
    """This machine's RAM (what `memory_fraction` takes a share of on the CPU)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_memory_bytes(device: str) -> int:
    """Total memory of this process's device: the GPU Ray gave it (index 0 of what it sees), else host RAM."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return host_memory_bytes()


def read_model_config(source: str, cache_dir: str | None = None, resolve: bool = True) -> dict[str, Any] | None:
    """A model's config.json, or None where it cannot be read here. `resolve=False` reads local directories only
    (validating a config must not download or convert models; the replica sizes itself when it loads)."""
    import json
    from pathlib import Path

    from .source_names import canonical_source, classify_source
    from .sources import resolve_model_dir

    try:
        if resolve:
            path = resolve_model_dir(canonical_source(source), Path(cache_dir) if cache_dir else None)
        else:
            kind, canonical = classify_source(source)
            if kind != "dir":
                return None
            path = Path(canonical)
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError, ModelLoadError):
        return None
