"""LoRA targets in the app: one target deployment serves a base model plus adapters, each its own model name.

The config (`lora:` on a target), where an adapter's directory is, how a forward's rows are split so that no forward
holds more adapters than the replica keeps resident, and the request bodies of the runtime load/unload routes (vLLM's
shapes). The per-row mechanism itself is core/lora.py's.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..core.types import ScoreRequest

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


def adapter_parts(requests: list[ScoreRequest], max_loaded: int) -> list[list[int]]:
    """Indices of `requests` in forwards of at most `max_loaded` distinct adapters (base rows ride in the first),
    in order; one part when they fit."""
    parts: list[list[int]] = [[]]
    held: list[set[str]] = [set()]
    for i, req in enumerate(requests):
        for part, names in zip(parts, held):
            if not req.adapter or req.adapter in names or len(names) < max_loaded:
                break
        else:
            parts.append([])
            held.append(set())
            part, names = parts[-1], held[-1]
        part.append(i)
        if req.adapter:
            names.add(req.adapter)
    return parts


def new_bank(spec) -> "LoraBank | None":
    """The replica's LoraBank for a target with `lora:` (None without)."""
    from ..core.lora import LoraBank

    return None if spec.lora is None else LoraBank(spec.lora.max_loaded, spec.lora.max_rank)


def register_adapter(bank, name: str, where: str) -> dict:
    """Read and register one adapter on a replica: {"loaded": name} or {"error": why} (a bad adapter changes
    nothing: it is checked whole before it is registered)."""
    from ..core.lora import AdapterError
    from ..models.adapters import read_peft_adapter

    if bank is None:
        return {"error": "this target serves no LoRA adapters (no `lora:` in its config)"}
    try:
        bank.register(read_peft_adapter(adapter_path(where), name))
    except AdapterError as exc:
        return {"error": str(exc)}
    return {"loaded": name}


def score_by_adapters(verifier, requests: list[ScoreRequest], expected: list[int]):
    """`replica.score_counted` in as many forwards as the adapters need (at most lora.max_loaded in each), answers
    in request order."""
    from .replica import score_counted

    bank = verifier.lora
    parts = adapter_parts(requests, bank.max_loaded) if bank is not None else [list(range(len(requests)))]
    if len(parts) == 1:
        return score_counted(verifier, requests, expected)
    out: list = [None] * len(requests)
    counts: list = [0] * len(requests)
    for idx in parts:
        logits, recomputed = score_counted(verifier, [requests[i] for i in idx], [expected[i] for i in idx])
        for j, i in enumerate(idx):
            out[i], counts[i] = logits[j], recomputed[j]
    return out, counts


class RouterAdapters:
    """The router's view of the adapters its targets serve: adapter model name -> base target, and the runtime
    load/unload of one adapter on every live replica of its base.

    A load reaches every replica of the base (each keeps it registered, `max_loaded` of them resident), so any
    replica can verify any adapter's rows and prefix routing needs no adapter preference. A load that any replica
    refuses is undone on the others."""

    def __init__(self, targets: list) -> None:
        self.base_of: dict[str, str] = {a: t.name for t in targets if t.lora for a in t.lora.adapters}
        self.lora_targets = [t.name for t in targets if t.lora is not None]
        self.configured = set(self.base_of)

    def target(self, model: str) -> tuple[str, str]:
        """(target name, adapter) of a requested model name ("" for a target's own model)."""
        base = self.base_of.get(model)
        return (base, model) if base is not None else (model, "")

    def base_for_load(self, body: LoadLoraRequest, models: dict) -> str:
        """Which target a load goes to; ValueError (a 400) for a name taken or no target to take it."""
        if body.lora_name in models:
            raise ValueError(f"lora_name: {body.lora_name!r} is already served here (unload it first)")
        if body.base_model is not None:
            if body.base_model not in self.lora_targets:
                raise ValueError(f"base_model: {body.base_model!r} is not a target with `lora:` in its config; "
                                 f"those are {self.lora_targets}")
            return body.base_model
        if len(self.lora_targets) != 1:
            raise ValueError("base_model: name the target to load onto, one of " + str(self.lora_targets)
                             if self.lora_targets else "lora_name: no target here serves LoRA adapters (give one a "
                             "`lora:` block in the config)")
        return self.lora_targets[0]

    @staticmethod
    async def on_every_replica(handle, method: str, *args) -> list[dict]:
        from .affinity import each_replica

        return await each_replica(handle, lambda key: getattr(handle, method).remote(*args, affinity=key))


def _in_use(sched, adapter: str) -> bool:
    """Whether a queued or running request of this scheduler decodes with `adapter`."""
    return any(r.adapter == adapter for r in sched.waiting.values()) or \
        any(s.req.adapter == adapter for s in sched.engine.seqs.values())


async def load_adapter(router, body: LoadLoraRequest) -> dict:
    """POST /v1/load_lora_adapter: register on every replica of the base, then serve the name; ApiError 400 for a
    bad adapter (every replica's registration undone, nothing else changed)."""
    from dataclasses import replace

    from .app_config import router_ceiling
    from .http_api import ApiError

    _one_router(router, router_ceiling)
    try:
        base = router.adapters.base_for_load(body, router.models)
    except ValueError as exc:
        field = str(exc).partition(":")[0]
        raise ApiError(400, str(exc), "invalid_value", field) from None
    handle = router.target_handles[base]
    replies = await RouterAdapters.on_every_replica(handle, "load_adapter", body.lora_name, body.lora_path)
    errors = [r["error"] for r in replies if "error" in r]
    if errors:
        await RouterAdapters.on_every_replica(handle, "unload_adapter", body.lora_name)
        raise ApiError(400, errors[0], "invalid_lora_adapter", "lora_path")
    router.adapters.base_of[body.lora_name] = base
    router.models[body.lora_name] = replace(router.models[base], name=body.lora_name)
    return {"object": "lora_adapter", "lora_name": body.lora_name, "base_model": base,
            "replicas": sorted(r["replica"] for r in replies)}


async def unload_adapter(router, body: UnloadLoraRequest, wait_s: float) -> dict:
    """POST /v1/unload_lora_adapter: new requests for the name get 404 at once; requests already admitted finish
    (up to `wait_s`), then every replica forgets it."""
    import asyncio
    import time

    from .app_config import router_ceiling
    from .http_api import ApiError

    _one_router(router, router_ceiling)
    base = router.adapters.base_of.get(body.lora_name)
    if base is None:
        raise ApiError(404, f"lora_name: adapter {body.lora_name!r} is not loaded here", "model_not_found",
                       "lora_name")
    del router.adapters.base_of[body.lora_name]
    router.models.pop(body.lora_name, None)
    sched, deadline = router.schedulers[base], time.monotonic() + wait_s
    while _in_use(sched, body.lora_name) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    replies = await RouterAdapters.on_every_replica(router.target_handles[base], "unload_adapter", body.lora_name)
    return {"object": "lora_adapter", "lora_name": body.lora_name, "base_model": base,
            "replicas": sorted(r["replica"] for r in replies)}


def _one_router(router, router_ceiling) -> None:
    from .http_api import ApiError

    if router_ceiling(router.cfg.router) > 1:
        raise ApiError(400, "runtime LoRA load/unload needs a single router replica (each router keeps its own list "
                       "of served names); list adapters under the target's `lora.adapters` instead",
                       "unsupported", "lora_name")
