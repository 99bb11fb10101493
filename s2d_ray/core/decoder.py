"""The model seam: the pieces of a Hugging Face decoder-only LM that speculation calls directly (embedding, layers,
rotary embedding, final norm, LM head), so any Llama-like family works; `decoder_parts` is where another family plugs
in."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Callable

from torch import nn

from .errors import ModelLoadError

logger = logging.getLogger(__name__)


@dataclass
class DecoderParts:
    """The pieces of a Hugging Face causal LM that speculation needs; the seam for other model families."""

    embed: nn.Module
    layers: nn.ModuleList
    rotary: nn.Module
    norm: nn.Module
    head: nn.Module
    num_kv_heads: int
    head_dim: int
    num_heads: int


def cache_kwarg(layer: nn.Module) -> str:
    """The name a decoder layer takes its KV cache by: `cache` in newer transformers, `past_key_values` in older ones.
    A wrong name is silently swallowed by **kwargs and the layer attends to no cache."""
    params = inspect.signature(layer.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _llama_like_parts(model: nn.Module) -> DecoderParts:
    cfg = model.config
    base = model.model
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    # Head counts from the projection weights, not the config: under tensor parallelism (DeepSpeed AutoTP) each
    # rank holds only its share of the heads, and its KV cache and masks must be sized for that share.
    attn = base.layers[0].self_attn
    return DecoderParts(
        embed=base.embed_tokens,
        layers=base.layers,
        rotary=base.rotary_emb,
        norm=base.norm,
        head=model.lm_head,
        num_kv_heads=attn.k_proj.weight.shape[0] // head_dim,
        head_dim=head_dim,
        num_heads=attn.q_proj.weight.shape[0] // head_dim,
    )


# Families whose decoder layer takes (hidden, attention_mask, position_ids, cache, position_embeddings).
FAMILY_PARTS: dict[str, Callable[[nn.Module], DecoderParts]] = {
    "llama": _llama_like_parts,
    "mistral": _llama_like_parts,
    "qwen2": _llama_like_parts,
    "qwen3": _llama_like_parts,
}


def decoder_parts(model: nn.Module) -> DecoderParts:
    """Split a causal LM into parts; raise a clear error for families without a layer-level seam yet."""
    model_type = getattr(model.config, "model_type", "?")
    if model_type not in FAMILY_PARTS:
        raise ModelLoadError(
            f"model family '{model_type}' is not supported for speculation yet; supported: {sorted(FAMILY_PARTS)}"
        )
    if getattr(model.config, "sliding_window", None) and getattr(model.config, "use_sliding_window", True):
        logger.warning("sliding-window attention is ignored: contexts must stay within the window")
    return FAMILY_PARTS[model_type](model)
