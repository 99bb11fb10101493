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


def model_context(source: str, cache_dir: str | None) -> int | None:
    """max_position_embeddings from the model's config.json, if it has one."""
    path = resolve_model_dir(canonical_source(source), Path(cache_dir) if cache_dir else None)
    cfg = json.loads((path / "config.json").read_text())
    value = cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get("max_position_embeddings")
    return int(value) if value else None
