"""Model shapes: what a forward reads (weights, KV) and computes, per tensor-parallel rank.

Only matmul weights and attention count: norms, rotary and the embedding lookup (one row per token) are noise
against them. A TP rank holds 1/tp of the heads, KV heads, MLP width and LM-head rows (Megatron/DeepSpeed AutoTP
split); its all-reduces are not modelled (two per layer, small at decode batch sizes, NVLink)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    head_rows: int | None = None  # a reduced-vocabulary LM head (sorted drafts): rows actually multiplied
    tp: int = 1

    def shard(self, tp: int) -> "ModelShape":
        """One rank's shapes under tensor parallelism over `tp` ranks."""
        if tp == 1:
            return self
        if self.heads % tp or self.kv_heads % tp or self.intermediate % tp:
            raise ValueError(f"{self.name}: heads {self.heads}, KV heads {self.kv_heads} and MLP width "
                             f"{self.intermediate} must divide by tp={tp}")
        return replace(self, heads=self.heads // tp, kv_heads=self.kv_heads // tp,
                       intermediate=self.intermediate // tp, vocab=-(-self.vocab // tp), tp=tp)

    def with_layers(self, layers: int, head_rows: int | None = None) -> "ModelShape":
        return replace(self, layers=layers, head_rows=head_rows)

    @property
    def layer_params(self) -> int:
        """Matmul weights of one decoder layer: q, k, v, o projections and the gated MLP's three matrices."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attn + 3 * self.hidden * self.intermediate

    def head_params(self, layers_only: bool = False) -> int:
        return 0 if layers_only else self.hidden * (self.head_rows or self.vocab)

    def weight_bytes(self, dtype_bytes: int, layers: int | None = None) -> int:
        """Weights one forward reads through `layers` layers (default: all) and one LM head."""
        n = self.layers if layers is None else layers
        return dtype_bytes * (n * self.layer_params + self.head_params())

    def kv_bytes_per_token(self, dtype_bytes: int, layers: int | None = None) -> int:
        n = self.layers if layers is None else layers
        return dtype_bytes * 2 * n * self.kv_heads * self.head_dim

    def forward_flops(self, rows: int, positions: int, context: int, layers: int | None = None,
                      logits: int | None = None) -> float:
        """FLOPs of one forward over rows x positions new tokens attending over `context` cached ones; the LM head
        runs on `logits` positions (default: all of them, as in verification)."""
        n = self.layers if layers is None else layers
        tokens = rows * positions
        attn = 4 * self.heads * self.head_dim * (context + positions)  # q.k and p.v per token per layer
        head = 2 * self.head_params() * (tokens if logits is None else logits)
        return tokens * n * (2 * self.layer_params + attn) + head

    def params(self) -> int:
        return self.layers * self.layer_params + self.hidden * self.vocab * 2  # + embedding (untied)

    def hf_config(self, layers: int | None = None, dtype: str = "bfloat16") -> dict:
        """A LlamaConfig dict with these (per-rank) shapes: random-weight timing needs no checkpoint."""
        return {"hidden_size": self.hidden, "intermediate_size": self.intermediate,
                "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
                "num_hidden_layers": self.layers if layers is None else layers, "vocab_size": self.vocab,
                "max_position_embeddings": 4096, "torch_dtype": dtype, "tie_word_embeddings": False}


def shape_of(config) -> ModelShape:
    """From a Hugging Face config (Llama-like families)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelShape(getattr(config, "name_or_path", "") or config.model_type, config.num_hidden_layers,
                      config.hidden_size, config.intermediate_size, heads,
                      getattr(config, "num_key_value_heads", None) or heads, head_dim, config.vocab_size)


# Public configs (config.json of each checkpoint); Vicuna-7B/13B v1.5 are Llama-2-7B/13B fine-tunes.
SHAPES = {
    "llama-2-7b": ModelShape("llama-2-7b", 32, 4096, 11008, 32, 32, 128, 32000),
    "llama-2-13b": ModelShape("llama-2-13b", 40, 5120, 13824, 40, 40, 128, 32000),
    "llama-2-70b": ModelShape("llama-2-70b", 80, 8192, 28672, 64, 8, 128, 32000),
    "smollm2-135m": ModelShape("smollm2-135m", 30, 576, 1536, 9, 3, 64, 49152),
}
ALIASES = {"vicuna-7b": "llama-2-7b", "vicuna-13b": "llama-2-13b", "llama-2-70b-chat": "llama-2-70b",
           "smollm2-135m-instruct": "smollm2-135m", "smollm2-135m-gsm8k": "smollm2-135m"}


def known_shape(source: str) -> ModelShape | None:
    """A shape from the table by a model name or path (e.g. /mnt/models/vicuna-7b-v1.5 -> llama-2-7b)."""
    key = source.rstrip("/").rsplit("/", 1)[-1].lower()
    for name in sorted([*SHAPES, *ALIASES], key=len, reverse=True):
        if key.startswith(name):
            return SHAPES[ALIASES.get(name, name)]
    return None
