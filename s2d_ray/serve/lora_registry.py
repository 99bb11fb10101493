"""The app's list of LoRA adapters loaded or unloaded at run time, shared by every router replica and every target
replica, so a runtime load or unload reaches them all whichever router took the HTTP call.

One registry replica (a deployment placed like the metrics hub) holds what changed since the config: adapters
loaded (name -> base target and directory) and configured adapters unloaded. Each router keeps a copy that it uses
for at most VIEW_TTL_S: a request for a model name the copy does not have, or for an adapter with a copy older
than that, first fetches a new one (`AdapterSync.ensure`), and while the router serves requests a loop
refreshes it every SYNC_S and reports which adapters the router's admitted requests use. An unload therefore takes
the name out of the registry, then waits until every router heard from in the last ROUTER_STALE_S has fetched the
change and reports no request of it running (bounded by the request timeout), and only then frees it on the
target replicas: once the unload returns, every router answers 404 for it. A target replica registers the runtime
adapters of its base before its first forward (`TargetDeployment.score`), so a replica started after a load (a
scale-up, a restart) serves it too.

The registry's state lives in its one replica: if that replica is replaced, runtime loads are forgotten (the
routers then stop serving those names) and must be made again; configured adapters are not affected.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from collections.abc import Callable

from ray import serve

logger = logging.getLogger(__name__)

VIEW_TTL_S = 2.0  # a router admits an adapter's request on a copy at most this old
CATCH_UP_TIMEOUT_S = 10.0  # the longest wait for the registry's answer (a router keeps its copy, a starting
# target replica tries again on its next call)
SYNC_S = 0.5  # how often a serving router refreshes its copy and reports its adapters in use
ROUTER_STALE_S = 10.0  # a router not heard from for this long is gone (its requests ended with it)


class AdapterRegistry:
    """Runtime adapter loads and unloads of the app (module docstring); one replica."""

    def __init__(self) -> None:
        self.epoch = uuid.uuid4().hex
        self.version = 0
        self.loaded: dict[str, tuple[str, str]] = {}  # name -> (base target, adapter directory), served
        self.pending: dict[str, tuple[str, str]] = {}  # loads under way (claimed, not committed)
        self.removed: dict[str, str] = {}  # configured adapter -> its base, unloaded at run time
        self.routers: dict[str, tuple[float, int, frozenset[str]]] = {}  # replica -> (last sync, version, in use)

    def claim(self, name: str, base: str, path: str) -> str | None:
        """Reserve a name for a load (None), or why not: it is served or being loaded already."""
        if name in self.loaded or name in self.pending:
            return f"lora_name: {name!r} is already served here (unload it first)"
        self.pending[name] = (base, path)
        return None

    def commit(self, name: str) -> int:
        """A claimed load reached every replica: every router serves it from the next copy it fetches."""
        self.loaded[name] = self.pending.pop(name)
        self.removed.pop(name, None)
        self.version += 1
        return self.version

    def release(self, name: str) -> None:
        """A claimed load failed: the name is free again."""
        self.pending.pop(name, None)

    def retire(self, name: str, base: str) -> int:
        """Stop serving an adapter (runtime or configured, of target `base`): the version routers must reach."""
        if self.loaded.pop(name, None) is None:
            self.removed[name] = base
        self.version += 1
        return self.version

    def sync(self, router: str, in_use: list[str]) -> dict:
        """A router's report (the adapters its admitted requests use) and its new copy."""
        self.routers[router] = (time.monotonic(), self.version, frozenset(in_use))
        return {"epoch": self.epoch, "version": self.version, "removed": dict(self.removed),
                "loaded": {name: base for name, (base, _) in self.loaded.items()}}

    def drained(self, name: str, version: int) -> bool:
        """Whether every router heard from lately has fetched `version` and runs no request of `name`."""
        now = time.monotonic()
        return all(seen >= version and name not in in_use for at, seen, in_use in self.routers.values()
                   if now - at <= ROUTER_STALE_S)

    def for_base(self, base: str) -> dict:
        """What a starting replica of `base` registers beyond its config: {"load": {name: dir}, "unload": [names]}
        (loads under way included: a replica that starts during one holds it when the load completes)."""
        load = {n: p for n, (b, p) in {**self.loaded, **self.pending}.items() if b == base}
        return {"load": load, "unload": [n for n, b in self.removed.items() if b == base]}


AdapterRegistryDeployment = serve.deployment(name="lora-registry", num_replicas=1)(AdapterRegistry)


class AdapterSync:
    """A router replica's copy of the registry (module docstring), applied to its own adapter names through
    `apply(loaded, removed)`; `in_use()` names the adapters of its admitted requests."""

    def __init__(self, registry, replica: str, apply: Callable[[dict, dict], None],
                 in_use: Callable[[], set[str]]) -> None:
        self.registry, self.replica, self.apply, self.in_use = registry, replica, apply, in_use
        self.fetched_at = -1e9  # when the current copy's fetch was sent (monotonic)
        self._fetch: asyncio.Future | None = None
        self._sent = -1e9
        self._loop: asyncio.Task | None = None

    async def ensure(self, model: str, known: bool) -> None:
        """Before a request for `model` (an adapter or an unknown name, never a target's own): a fresh copy where
        the name is unknown here (it may have been loaded through another router) or the copy is older than
        VIEW_TTL_S (the adapter may have been unloaded through another router, configured ones included)."""
        if not known or time.monotonic() - self.fetched_at > VIEW_TTL_S:
            await self.refresh()

    async def refresh(self) -> None:
        """Fetch and apply a new copy; concurrent callers share a fetch, one sent after they asked."""
        self.start()
        asked = time.monotonic()
        while True:
            if self._fetch is None:
                self._sent = time.monotonic()
                fetch = self._fetch = asyncio.ensure_future(self._refresh_once(self._sent))
                fetch.add_done_callback(lambda done: setattr(self, "_fetch", None) if self._fetch is done else None)
            sent, fetch = self._sent, self._fetch
            await asyncio.shield(fetch)
            if sent >= asked:
                return

    async def _refresh_once(self, sent: float) -> None:
        try:
            copy = await asyncio.wait_for(self.registry.sync.remote(self.replica, sorted(self.in_use())),
                                          CATCH_UP_TIMEOUT_S)
        except Exception:  # the registry is being replaced: keep the copy (the unload that needs it waits too)
            logger.warning("adapter registry unreachable", exc_info=True)
            return
        self.apply(copy["loaded"], copy["removed"])
        self.fetched_at = sent

    def start(self) -> None:
        """Start the periodic refresh (once, at the first fetch: a router the registry heard from keeps reporting;
        in a fresh context, as it outlives the request that starts it)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop().create_task(self._periodic(), context=contextvars.Context())

    async def _periodic(self) -> None:
        while True:
            await asyncio.sleep(SYNC_S)
            await self.refresh()
