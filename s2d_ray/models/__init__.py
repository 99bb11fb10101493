"""Model sources and loading: named sources (PyPI wheels, LoRA merges), HF directories, GGUF files, hub ids, by
their names (source_names.py), built once into the cache (conversions.py, model_cache.py) and resolved to a directory
(sources.py); sorted drafts on disk (drafts.py); KV capacity from memory (capacity.py); tensor-parallel shards
(shards.py).

Only a hub id contacts the hub, and not with HF_HUB_OFFLINE=1 (the operator's switch); every load reads a local
directory (local_files_only=True).
"""

from s2d_ray.models.drafts import DRAFT_CONFIG, DRAFT_WEIGHTS, load_draft, save_draft
from s2d_ray.models.loader import LoadedModel, check_same_vocabulary, load_model
from s2d_ray.models.model_cache import default_cache_dir, sha256_file
from s2d_ray.models.source_names import NAMED_SOURCES, NamedSource, canonical_source, register_source
from s2d_ray.models.sources import resolve_model_dir

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
