"""Router-side loaders: what the ingress needs from a model's files (tokenizer, context length), without weights."""

from __future__ import annotations

import json
from pathlib import Path

from ..models import canonical_source, resolve_model_dir


def load_tokenizer(source: str, cache_dir: str | None, trust_remote_code: bool, chat_template: str | None = None):
    """A source's tokenizer without its weights (the router needs text <-> ids only), with the configured chat
    template (`targets[].chat_template`) over its own."""
    from transformers import AutoTokenizer

    from ..prompts import override_chat_template

    path = resolve_model_dir(canonical_source(source), Path(cache_dir) if cache_dir else None)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    override_chat_template(tokenizer, chat_template)
    return tokenizer


def model_config(source: str, cache_dir: str | None) -> dict:
    """The model's config.json, read without loading the model (what a router and a deployment size by)."""
    path = resolve_model_dir(canonical_source(source), Path(cache_dir) if cache_dir else None)
    return json.loads((path / "config.json").read_text())
