"""A sorted draft on disk: its spec as JSON and only the weights that differ from its base, as safetensors.

A draft directory holds `s2d_draft.json` (the DraftSpec: base model, layers, exits, thresholds, provenance) and
`draft.safetensors` (its layers; its norm and head when trained; with a reduced vocabulary only the head's rows it
proposes from, and their token ids). The embedding, and the norm and head of an untrained cut, come from the base.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..core.draft import DraftSpec, SortedDraft
from ..core.kernels import STOCK, Kernels
from ..core.decoder import decoder_parts
from ..errors import ModelLoadError

DRAFT_CONFIG = "s2d_draft.json"
DRAFT_WEIGHTS = "draft.safetensors"


def save_draft(draft: SortedDraft, directory: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write `draft` to `directory`: only what differs from the base is stored."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {f"layers.{k}": v for k, v in draft.layers.state_dict().items()}
    if draft.spec.trained_norm_head:
        tensors.update({f"norm.{k}": v for k, v in draft.parts.norm.state_dict().items()})
        if draft.vocab_ids is None:
            tensors.update({f"head.{k}": v for k, v in draft.parts.head.state_dict().items()})
        else:  # only the rows the draft proposes from: a small share of the full head
            tensors["head_rows"] = draft.parts.head.weight[draft.vocab_ids]
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in tensors.items()}
    if draft.vocab_ids is not None:
        tensors["vocab_ids"] = draft.vocab_ids.to(torch.int64).contiguous()
    save_file(tensors, str(directory / DRAFT_WEIGHTS))
    (directory / DRAFT_CONFIG).write_text(json.dumps(asdict(draft.spec), indent=2))


def load_draft(directory: Path, base_model: nn.Module, kernels: Kernels = STOCK) -> SortedDraft:
    """Load layer weights from `directory`; embedding (and norm/head unless trained) come from the base. `kernels`
    (core/kernels.py): how the draft's layer stack attends and projects."""
    cfg_path, w_path = directory / DRAFT_CONFIG, directory / DRAFT_WEIGHTS
    if not cfg_path.exists() or not w_path.exists():
        raise ModelLoadError(f"{directory} is not a draft directory: need {DRAFT_CONFIG} and {DRAFT_WEIGHTS}")
    spec = DraftSpec(**json.loads(cfg_path.read_text()))
    parts = decoder_parts(base_model)
    dtype = parts.head.weight.dtype
    tensors = load_file(str(w_path))
    layers = nn.ModuleList(copy.deepcopy(list(parts.layers)[: spec.num_layers]))
    layers.load_state_dict(_strip(tensors, "layers."), strict=True)
    if spec.trained_norm_head:
        parts = copy.copy(parts)
        parts.norm, parts.head = copy.deepcopy(parts.norm), copy.deepcopy(parts.head)
        parts.norm.load_state_dict(_strip(tensors, "norm."))
        if "head_rows" in tensors:  # reduced vocabulary: the trained rows over the base head (others unused)
            with torch.no_grad():
                parts.head.weight[tensors["vocab_ids"]] = tensors["head_rows"].to(parts.head.weight.dtype)
        else:
            parts.head.load_state_dict(_strip(tensors, "head."))
    draft = SortedDraft(parts, spec, layers, tensors.get("vocab_ids"), kernels).to(dtype)
    draft.requires_grad_(False)
    return draft


def _strip(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
