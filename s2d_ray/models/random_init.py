"""Random-weight models for measurements: a directory with a config.json, a word-level tokenizer of the model's
vocabulary and `s2d_random_init.json` (its seed), but no weights. Loading builds the model from its config, seeded,
directly on the device, so a 7B-shaped target on a GPU needs no checkpoint on disk or in host memory; every process
that loads the directory gets the same weights (a draft cut from its first layers matches the target's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

RANDOM_INIT = "s2d_random_init.json"
SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2 (Llama-2's)


def word_tokenizer(vocab_size: int):
    """A whitespace word-level tokenizer of exactly `vocab_size` tokens: w3 ... w<V-1> after the specials, so any
    id a model of that vocabulary generates decodes, and a prompt of such words encodes to chosen ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def write_random_model(directory: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """A random-init model directory for `config` (a LlamaConfig dict): no weights written."""
    directory.mkdir(parents=True, exist_ok=True)
    full = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "bos_token_id": 1, "eos_token_id": 2,
            "initializer_range": 0.02, "rms_norm_eps": 1e-5, **config}
    (directory / "config.json").write_text(json.dumps(full, indent=1))
    word_tokenizer(int(full["vocab_size"])).save_pretrained(directory)
    (directory / RANDOM_INIT).write_text(json.dumps({"seed": seed}))
    return directory


def is_random_init(path: Path) -> bool:
    return (path / RANDOM_INIT).is_file()


def build_random(path: Path, dtype: torch.dtype, device: torch.device | str) -> torch.nn.Module:
    """The model of a random-init directory, built on `device` in `dtype` from its seed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    seed = json.loads((path / RANDOM_INIT).read_text())["seed"]
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model
