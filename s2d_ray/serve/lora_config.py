"""The `lora:` block of a target (which adapters, how many resident, the largest rank), where an adapter's directory
is, and the bodies of the runtime load/unload routes (vLLM's shapes). serve/lora.py serves them."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

ASSET_ADAPTERS = Path(__file__).resolve().parent.parent / "assets" / "adapters"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


def adapter_path(value: str) -> Path:
    """An adapter's directory: a path, or the name of an adapter committed with the package (assets/adapters)."""
    path = Path(value).expanduser()
    if path.is_dir():
        return path.resolve()
    committed = ASSET_ADAPTERS / value
    if "/" not in value and committed.is_dir():
        return committed
    return path


def check_adapter_name(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"adapter name {name!r} must be 1-128 letters, digits and ._:/- (a model name)")
    return name


class LoraTargetConfig(BaseModel):
    """`lora:` on a target: the adapters served over its base model, each exposed as a model of its own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    adapters: dict[str, str] = Field(
        default_factory=dict, description="Model name -> peft adapter directory (or the name of an adapter shipped "
        "in s2d_ray/assets/adapters); loaded when each replica starts. More load at run time through "
        "POST /v1/load_lora_adapter.")
    max_loaded: int = Field(4, ge=1, le=256, description="Adapters resident in each replica's stacked slots (LRU); "
                            "a forward holds at most this many adapters (larger rounds are split).")
    max_rank: int = Field(64, ge=1, le=1024, description="Largest adapter rank accepted (the slots' width).")

    @field_validator("adapters")
    @classmethod
    def _paths_exist(cls, adapters: dict[str, str]) -> dict[str, str]:
        for name, where in adapters.items():
            check_adapter_name(name)
            if not (adapter_path(where) / "adapter_config.json").is_file():
                raise ValueError(f"adapter {name}: {where} is not a peft adapter directory (no adapter_config.json)")
        return adapters


class LoadLoraRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body); `base_model` names the target where several serve adapters."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str
    base_model: str | None = None

    @field_validator("lora_name")
    @classmethod
    def _name(cls, name: str) -> str:
        return check_adapter_name(name)


class UnloadLoraRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's body; `lora_int_id` is accepted and ignored as vLLM does)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None
