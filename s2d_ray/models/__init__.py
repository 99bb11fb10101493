"""Model sources and loading: named sources (PyPI wheels, LoRA merges), HF directories, GGUF files, hub ids; sorted
drafts on disk (drafts.py); KV capacity from memory (capacity.py); tensor-parallel shards (shards.py).

Only a hub id contacts the hub, and not with HF_HUB_OFFLINE=1 (the operator's switch); every load reads a local
directory (local_files_only=True).
"""

from s2d_ray.models.drafts import DRAFT_CONFIG, DRAFT_WEIGHTS, load_draft, save_draft
from s2d_ray.models.loader import LoadedModel, check_same_vocabulary, load_model
from s2d_ray.models.sources import (
    NAMED_SOURCES,
    NamedSource,
    canonical_source,
    default_cache_dir,
    register_source,
    resolve_model_dir,
    sha256_file,
)

__all__ = [
    "DRAFT_CONFIG",
    "DRAFT_WEIGHTS",
    "NAMED_SOURCES",
    "LoadedModel",
    "NamedSource",
    "canonical_source",
    "check_same_vocabulary",
    "default_cache_dir",
    "load_draft",
    "load_model",
    "register_source",
    "resolve_model_dir",
    "save_draft",
    "sha256_file",
]
