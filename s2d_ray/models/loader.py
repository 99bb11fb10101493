"""Load a causal LM + tokenizer from any source, ready for inference (eval mode, no gradients, pad token set)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from s2d_ray.errors import ConfigError, ModelLoadError, TokenizerMismatchError
from s2d_ray.models.random_init import build_random, is_random_init
from s2d_ray.models.source_names import NAMED_SOURCES, canonical_source, looks_like_path
from s2d_ray.models.sources import resolve_model_dir

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model ready for decoding, plus where it came from (for logs, manifests and vocabulary checks)."""

    model: transformers.PreTrainedModel = field(repr=False)
    tokenizer: transformers.PreTrainedTokenizerBase = field(repr=False)
    source: str
    path: Path


def _canonical_allowed(entry: str) -> str:
    """Canonicalize an allow-list entry without requiring it to exist (paths become absolute)."""
    text = entry.strip()
    if text in NAMED_SOURCES:
        return text
    path = Path(text).expanduser()
    if looks_like_path(text) or path.exists():
        return str(path.resolve())
    return text


def _check_allowed(source: str, allowed_sources: list[str] | None) -> None:
    if allowed_sources is None:
        return
    allowed = {_canonical_allowed(a) for a in allowed_sources}
    if _canonical_allowed(source) not in allowed:
        raise ConfigError(
            f"model source {source!r} is not in allowed_sources {sorted(allowed)}; "
            "fix: add it to allowed_sources in the configuration, or use one of the allowed sources"
        )


def _check_remote_code(path: Path, trust_remote_code: bool) -> None:
    """Refuse checkpoints that would execute their own Python code unless the caller opted in."""
    if trust_remote_code:
        return
    for name in ("config.json", "tokenizer_config.json"):
        file = path / name
        if not file.is_file():
            continue
        try:
            data: dict[str, Any] = json.loads(file.read_text())
        except ValueError:
            continue
        if data.get("auto_map"):
            raise ModelLoadError(
                f"{file} declares custom code (auto_map), which would run arbitrary Python; "
                "fix: pass trust_remote_code=True only if you trust this checkpoint"
            )


def _ensure_pad_token(tokenizer: transformers.PreTrainedTokenizerBase, model: transformers.PreTrainedModel) -> None:
    """Batching needs a pad id; reuse eos (or unk) so the vocabulary never grows."""
    if tokenizer.pad_token_id is None:
        fallback = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
        if fallback is None:
            logger.warning("tokenizer has no pad, eos or unk token; pad_token_id stays None")
            return
        tokenizer.pad_token = fallback
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id


def _check_tokenizer_fits(tokenizer: transformers.PreTrainedTokenizerBase, model: transformers.PreTrainedModel,
                          source: str) -> None:
    """Token ids beyond the embedding table would crash mid-request; catch it at load time."""
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise ModelLoadError(
            f"{source}: tokenizer has {len(tokenizer)} tokens but the model embeds only {rows}; "
            "fix: use the tokenizer saved with this model"
        )


def load_model(
    source: str,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: Path | None = None,
    trust_remote_code: bool = False,
    allowed_sources: list[str] | None = None,
    device: torch.device | str = "cpu",
) -> LoadedModel:
    """Resolve `source` (name, HF dir, hub id or .gguf), load model + tokenizer, and prepare them for inference.
    `device`: where a random-init directory (models/random_init.py) builds its model; checkpoints load on the CPU."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating torch.dtype, got {dtype!r}; fix: use torch.float32 or bfloat16")
    _check_allowed(source, allowed_sources)
    canonical = canonical_source(source)
    path = resolve_model_dir(canonical, cache_dir)
    _check_remote_code(path, trust_remote_code)
    started = time.perf_counter()
    common: dict[str, Any] = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    try:
        if is_random_init(path):
            model = build_random(path, dtype, device)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **common)
        tokenizer = AutoTokenizer.from_pretrained(path, **common)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(
            f"could not load {canonical} from {path} ({type(exc).__name__}: {exc}); "
            "fix: re-save the directory with save_pretrained, or delete the cached copy so it is rebuilt"
        ) from exc
    model.eval()
    model.requires_grad_(False)
    _ensure_pad_token(tokenizer, model)
    _check_tokenizer_fits(tokenizer, model, canonical)
    logger.info("loaded %s (%s) from %s in %.2f s", canonical, dtype, path, time.perf_counter() - started)
    return LoadedModel(model=model, tokenizer=tokenizer, source=canonical, path=path)


def _special_ids(tok: transformers.PreTrainedTokenizerBase) -> dict[str, int | None]:
    return {"eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id}


def check_same_vocabulary(
    tok_a: transformers.PreTrainedTokenizerBase,
    tok_b: transformers.PreTrainedTokenizerBase,
    name_a: str,
    name_b: str,
) -> None:
    """Draft tokens are verified by id, so draft and target must map every token string to the same id."""
    vocab_a, vocab_b = tok_a.get_vocab(), tok_b.get_vocab()
    problems: list[str] = []
    if len(vocab_a) != len(vocab_b):
        problems.append(f"vocabulary sizes differ ({len(vocab_a)} vs {len(vocab_b)})")
    if vocab_a != vocab_b:
        differing = sorted(t for t in vocab_a.keys() | vocab_b.keys() if vocab_a.get(t) != vocab_b.get(t))
        examples = ", ".join(f"{t!r}: {vocab_a.get(t)} vs {vocab_b.get(t)}" for t in differing[:5])
        problems.append(f"{len(differing)} tokens map to different ids (e.g. {examples})")
    ids_a, ids_b = _special_ids(tok_a), _special_ids(tok_b)
    for key in ids_a:
        if ids_a[key] != ids_b[key]:
            problems.append(f"{key} differs ({ids_a[key]} vs {ids_b[key]})")
    if problems:
        raise TokenizerMismatchError(
            f"{name_a} and {name_b} do not share a tokenizer: {'; '.join(problems)}; "
            "fix: pair a draft and targets from one tokenizer family (e.g. all SmolLM2-based)"
        )
