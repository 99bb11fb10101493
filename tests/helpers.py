"""Tiny random models and tokenizers for fast tests (no downloads, a few ms each).

The tiny tokenizer is a byte-level BPE (it can encode any text) with ChatML special tokens and chat template,
mirroring SmolLM2's layout (bos `<|im_start|>`=1, eos `<|im_end|>`=2) so code under test sees the same shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TINY_VOCAB_SIZE = 320
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_TRAINING_TEXT = [
    "What is the capital of France? The capital of France is Paris.",
    "Write a short poem about the sea and the sky.",
    "def add(a, b):\n    return a + b\n",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Translate to German: good morning, how are you today?",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
]


def make_tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A deterministic byte-level BPE of exactly `vocab_size` tokens (>= 259), without a pad token."""
    if vocab_size < 256 + len(TINY_SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(TINY_SPECIAL_TOKENS)} (byte alphabet + specials)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=TINY_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus with numbered variants so the trainer always finds enough merges.
    corpus = [f"{line} {i} {i * 7}" for i in range(200) for line in _TRAINING_TEXT]
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    if len(fast) != vocab_size:
        raise AssertionError(f"tiny tokenizer has {len(fast)} tokens, wanted {vocab_size}")
    return fast


def make_tiny_llama(
    vocab_size: int = TINY_VOCAB_SIZE,
    num_layers: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    hidden_size: int = 32,
) -> LlamaForCausalLM:
    """A random LlamaForCausalLM (GQA 4/2 heads, tied embeddings like SmolLM2), eval mode, deterministic per seed."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    model.eval()
    return model


def save_tiny_llama(
    directory: Path,
    vocab_size: int = TINY_VOCAB_SIZE,
    num_layers: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a tiny model + matching tokenizer as a HF directory (config.json, model.safetensors, tokenizer)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    make_tiny_llama(vocab_size=vocab_size, num_layers=num_layers, seed=seed, dtype=dtype).save_pretrained(directory)
    make_tiny_tokenizer(vocab_size=vocab_size).save_pretrained(directory)
    return directory



def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (transformers reverses it on GGUF load), so round trips are exact."""
    dim = weights.shape[0] // n_head // 2
    return weights.reshape(n_head, 2, dim, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def write_tiny_gguf(path: Path, vocab_size: int = TINY_VOCAB_SIZE, num_layers: int = 2, seed: int = 0) -> Path:
    """Write `make_tiny_llama(...)` + tokenizer as an F32 llama GGUF, so GGUF conversion is testable offline.

    Loading the file back gives exactly the weights and vocabulary of `save_tiny_llama` with the same arguments.
    """
    import gguf  # here, not at the top: the GPU machine's image has no gguf, and only GGUF tests need it

    model = make_tiny_llama(vocab_size=vocab_size, num_layers=num_layers, seed=seed)
    tok_json = json.loads(make_tiny_tokenizer(vocab_size=vocab_size).backend_tokenizer.to_str())
    vocab: dict[str, int] = dict(tok_json["model"]["vocab"])
    vocab.update({added["content"]: added["id"] for added in tok_json["added_tokens"]})
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok_json["model"]["merges"]]
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(vocab_size)
    writer.add_rope_dimension_count(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in TINY_SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(CHATML_TEMPLATE)

    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            w = state[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                w = _llama_cpp_permute(w, cfg.num_attention_heads)
            elif gguf_name == "attn_k":
                w = _llama_cpp_permute(w, cfg.num_key_value_heads)
            writer.add_tensor(f"blk.{i}.{gguf_name}.weight", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def save_random_lora(base, path: Path, seed: int, r: int = 4, modules=None, rslora: bool = False,
                     scale: float = 0.3) -> Path:
    """A random peft LoRA of `base` saved with save_pretrained (B non-zero, so it changes the output); `base` is
    left as it was (the benchmark's maker, s2d_ray/bench/lora.py)."""
    from s2d_ray.bench.lora import LLAMA_PROJECTIONS, random_adapter

    return random_adapter(base, path, seed, r, scale, modules or LLAMA_PROJECTIONS, rslora)


def merge_lora(base, path: Path):
    """`base` with the adapter at `path` merged into its weights (peft merge_and_unload), on a copy."""
    from s2d_ray.bench.lora import merged_model

    return merged_model(base, path)
