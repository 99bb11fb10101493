"""LoRA adapter directories (peft's save_pretrained format) read for a verifier's LoraBank (core/lora.py)."""

from __future__ import annotations

import json
from pathlib import Path

from ..core.lora import AdapterError, LoraWeights, from_peft

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def read_peft_adapter(path: str | Path, name: str | None = None) -> LoraWeights:
    """The adapter saved in directory `path`, served as `name` (default: the directory's name); AdapterError, naming
    the problem, for a missing or unreadable directory or an adapter kind the bank cannot apply."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file, weights_file = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not cfg_file.is_file() or not weights_file.is_file():
        raise AdapterError(f"adapter {path}: no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} there (a peft LoRA directory "
                           "saved with save_pretrained)")
    try:
        cfg = json.loads(cfg_file.read_text())
        state = load_file(str(weights_file))
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter {path}: cannot read it ({type(exc).__name__}: {exc})") from None
    if not isinstance(cfg, dict) or "r" not in cfg:
        raise AdapterError(f"adapter {path}: {ADAPTER_CONFIG} names no rank `r`")
    return from_peft(name or path.name, cfg, state)
