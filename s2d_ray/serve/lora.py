"""LoRA targets in the app: one target deployment serves a base model plus adapters, each its own model name.

How a forward's rows are split so that no forward holds more adapters than the replica keeps resident, a replica's
registration of an adapter, and the router's side: adapter names -> base target, the runtime load/unload on every
replica, each adapter's draft thresholds. The config is serve/lora_config.py's; the per-row mechanism core/lora.py's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from ..core.types import ScoreRequest
from .deployment_options import router_ceiling
from .lora_config import LoadLoraRequest, UnloadLoraRequest, adapter_path

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
    except (OSError, ValueError) as exc:  # a path the OS refuses (a NUL byte, too long, no permission)
        return {"error": f"adapter {name}: cannot read {where!r} ({type(exc).__name__}: {exc})"}
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
    replica can verify any adapter's rows; adapter affinity (serve/affinity.py) only steers a new sequence to a
    replica that holds its adapter resident. A load that any replica refuses is undone on the others."""

    def __init__(self, cfg, registry=None, forget: Callable[[str], None] = lambda name: None) -> None:
        targets = cfg.targets
        self.base_of: dict[str, str] = {a: t.name for t in targets if t.lora for a in t.lora.adapters}
        self.configured = frozenset(self.base_of)
        self.targets = frozenset(t.name for t in targets)
        self.registry = registry  # serve/lora_registry.py: runtime loads shared by every router (None: this one's)
        self.forget = forget  # the name was unloaded: no replica holds it any more (adapter residency)
        self.being_prepared: dict[str, int] = {}  # adapter -> its requests admitted, not yet in a scheduler
        self.lora_targets = [t.name for t in targets if t.lora is not None]
        # The draft's thresholds per adapter, from a calibration profile named after it (as a target's is).
        self.thresholds = {a: th for a, base in self.base_of.items()
                           if (th := adapter_thresholds(cfg, base, a)) is not None}

    def generation(self, model: str, gen):
        """(target name, the GenerationRequest with its adapter and the adapter's draft thresholds)."""
        from dataclasses import replace

        base, adapter = self.target(model)
        if not adapter:
            return base, gen
        return base, replace(gen, adapter=adapter, draft_thresholds=self.thresholds.get(adapter))

    def target(self, model: str) -> tuple[str, str]:
        """(target name, adapter) of a requested model name ("" for a target's own model)."""
        base = self.base_of.get(model)
        return (base, model) if base is not None else (model, "")

    @contextlib.contextmanager
    def preparing(self, model: str):
        """While a request for `model` is prepared: an adapter's use before its scheduler holds it."""
        adapter = model if model in self.base_of else None
        if adapter is not None:
            self.being_prepared[adapter] = self.being_prepared.get(adapter, 0) + 1
        try:
            yield
        finally:
            if adapter is not None:
                self.being_prepared[adapter] -= 1
                if not self.being_prepared[adapter]:
                    del self.being_prepared[adapter]

    def serve(self, models: dict, name: str, base: str) -> None:
        """Serve `name` as an adapter of `base` (its model info is the base's, under its own name)."""
        from dataclasses import replace

        if self.base_of.get(name) != base or name not in models:
            self.base_of[name] = base
            models[name] = replace(models[base], name=name)

    def drop(self, models: dict, name: str) -> None:
        """Stop serving adapter `name`: new requests for it 404."""
        if self.base_of.pop(name, None) is not None:
            models.pop(name, None)
            self.forget(name)

    def apply(self, models: dict, loaded: dict[str, str], removed: dict[str, str]) -> None:
        """A copy of the registry: serve its runtime loads, drop runtime adapters it no longer has and configured
        ones it unloaded."""
        for name, base in loaded.items():
            self.serve(models, name, base)
        for name in list(self.base_of):
            if name not in loaded and (name not in self.configured or name in removed):
                self.drop(models, name)

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


def adapter_residency(cfg, target: str):
    """The router's record of which replicas of `target` hold which adapters (serve/affinity.py, adapter affinity);
    None for a target without `lora:` or with `router.prefix_routing.adapter_affinity` off."""
    from .affinity import AdapterResidency

    lora = cfg.target(target).lora
    if lora is None or not cfg.router.prefix_routing.adapter_affinity:
        return None
    return AdapterResidency(lora.max_loaded)


def in_use(schedulers, adapters: RouterAdapters) -> set[str]:
    """The adapters of the requests being prepared, queued and running in these schedulers."""
    return {name for name, n in adapters.being_prepared.items() if n > 0} | \
        {r.adapter for sched in schedulers for r in sched.waiting.values() if r.adapter} | \
        {s.req.adapter for sched in schedulers for s in sched.engine.seqs.values() if s.req.adapter}


async def load_adapter(router, body: LoadLoraRequest) -> dict:
    """POST /v1/load_lora_adapter: claim the name in the app's registry, register on every replica of the base,
    then serve the name (every router, from its next copy of the registry); ApiError 400 for a bad adapter (every
    replica's registration undone, nothing else changed)."""
    from .http_api import ApiError

    registry = router.adapters.registry
    _shared_or_one_router(router, body.base_model)
    if registry is not None:
        await router.adapter_sync.refresh()  # a name loaded through another router is taken
    try:
        base = router.adapters.base_for_load(body, router.models)
        _shared_or_one_router(router, base)
        claimed = await _ask(registry.claim.remote(body.lora_name, base, body.lora_path)) if registry else None
        if claimed is not None:
            raise ValueError(claimed)
    except ValueError as exc:
        field = str(exc).partition(":")[0]
        raise ApiError(400, str(exc), "invalid_value", field) from None
    handle = router.target_handles[base]
    try:
        replies = await RouterAdapters.on_every_replica(handle, "load_adapter", body.lora_name, body.lora_path)
        errors = [r["error"] for r in replies if "error" in r]
        if errors:
            await RouterAdapters.on_every_replica(handle, "unload_adapter", body.lora_name)
            raise ApiError(400, errors[0], "invalid_lora_adapter", "lora_path")
    except BaseException:
        if registry is not None:
            await _ask(registry.release.remote(body.lora_name))
        raise
    if registry is not None:
        await _ask(registry.commit.remote(body.lora_name))
        await router.adapter_sync.refresh()
    router.adapters.serve(router.models, body.lora_name, base)
    return {"object": "lora_adapter", "lora_name": body.lora_name, "base_model": base, "router": router.replica,
            "replicas": sorted(r["replica"] for r in replies)}


async def unload_adapter(router, body: UnloadLoraRequest, wait_s: float) -> dict:
    """POST /v1/unload_lora_adapter: new requests for the name get 404 at once on this router, and on every router
    before this returns; requests already admitted (on any router) finish, up to `wait_s`; then every replica
    forgets it."""
    import asyncio
    import time

    from .http_api import ApiError

    registry = router.adapters.registry
    if registry is not None:
        await router.adapter_sync.refresh()  # a name loaded or unloaded through another router
    base = router.adapters.base_of.get(body.lora_name)
    if base is None:
        raise ApiError(404, f"lora_name: adapter {body.lora_name!r} is not loaded here", "model_not_found",
                       "lora_name")
    _shared_or_one_router(router, base)
    deadline = time.monotonic() + wait_s
    if registry is None:
        router.adapters.drop(router.models, body.lora_name)
        while body.lora_name in in_use([router.schedulers[base]], router.adapters) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    else:
        version = await _ask(registry.retire.remote(body.lora_name, base))
        router.adapters.drop(router.models, body.lora_name)  # out of the registry first: no fetch brings it back
        await router.adapter_sync.refresh()  # this router's report: the version reached, what it still runs
        while not await _ask(registry.drained.remote(body.lora_name, version)) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            await router.adapter_sync.refresh()
    replies = await RouterAdapters.on_every_replica(router.target_handles[base], "unload_adapter", body.lora_name)
    return {"object": "lora_adapter", "lora_name": body.lora_name, "base_model": base, "router": router.replica,
            "replicas": sorted(r["replica"] for r in replies)}


async def _ask(call):
    """A call to the adapter registry, bounded: a 503 when it does not answer (Serve is replacing it)."""
    import asyncio

    from .http_api import ApiError
    from .lora_registry import CATCH_UP_TIMEOUT_S

    try:
        return await asyncio.wait_for(call, CATCH_UP_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise ApiError(503, f"the adapter registry did not answer in {CATCH_UP_TIMEOUT_S:.0f} s; try again",
                       "service_unavailable", type_="server_error", retry_after_s=1.0) from None


def _shared_or_one_router(router, base: str | None) -> None:
    """Runtime loads reach every router through the registry; a target placed in the router is each router's own,
    so its runtime loads need a single router replica."""
    from .http_api import ApiError

    placed = base is not None and base in router.cfg.placed_targets
    if router_ceiling(router.cfg.router) > 1 and (router.adapters.registry is None or placed):
        raise ApiError(400, "runtime LoRA load/unload on a target placed in the router needs a single router replica "
                       "(each router holds its own copy of the model); list adapters under the target's "
                       "`lora.adapters` instead", "unsupported", "lora_name")


def adapter_thresholds(cfg, base: str, adapter: str) -> tuple[float, ...] | None:
    """The draft's exit thresholds for an adapter's rows: those of a calibration profile committed with the draft
    under the adapter's name (s2d calibrate, as for a target), where its exit layers are the base's (the draft
    forward is shared, so only thresholds can differ per row); None: the base's."""
    from ..build import load_profile

    base_cfg = cfg.engine_config(base)
    if base_cfg.target.calibration != "auto":  # a profile the config names is the base's own
        return None
    own = base_cfg.model_copy(update={"target": base_cfg.target.model_copy(update={"name": adapter,
                                                                                    "source": adapter})})
    profile, base_profile = load_profile(own), load_profile(base_cfg)
    if profile is None or profile.get("thresholds") is None:
        return None
    base_exits = (base_profile or {}).get("exit_layers") or cfg.draft.exit_layers
    if cfg.draft.exit_layers is not None or cfg.draft.thresholds is not None or \
            profile.get("exit_layers") != base_exits:
        return None  # the config's own exits or thresholds win, as they do over a target's profile
    return tuple(profile["thresholds"])
