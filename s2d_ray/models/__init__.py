"""Model sources and loading: named sources (PyPI wheels, LoRA merges), HF directories, GGUF files; sorted drafts on
disk (drafts.py).

The model hub is never contacted: HF_HUB_OFFLINE defaults to 1 and every load passes local_files_only=True.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from s2d_ray.models.drafts import DRAFT_CONFIG, DRAFT_WEIGHTS, load_draft, save_draft  # noqa: E402
from s2d_ray.models.loader import LoadedModel, check_same_vocabulary, load_model  # noqa: E402
from s2d_ray.models.sources import (  # noqa: E402
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
