"""Readiness per model, for load balancers: which targets have a running replica now, from one call to Serve's
controller (`serve.status()`), cached briefly so frequent probes cost the controller one call per interval; and the
verdict of the operator's /stats.

Liveness (`/health`) is the router answering at all and needs nothing from here. A model is ready when its target
deployment has a RUNNING replica (or it is loaded in the router itself, `placement: router`); one target reloading
leaves the others ready. The draft is reported but never makes a model unready: without it rounds go target-only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

logger = logging.getLogger(__name__)

READY_TTL_S = 1.0  # probes within this reuse the last answer
STALE_AFTER_S = 30.0  # a controller that has not answered for this long makes every model's state unknown
STATUS_TIMEOUT_S = 5.0


@dataclass
class Readiness:
    models: dict[str, bool]
    draft: bool | None  # None: the app runs no draft deployment
    error: str | None = None  # why the states are unknown (then no model is ready)

    def body(self) -> dict:
        ready = [m for m, ok in self.models.items() if ok]
        status = "ready" if len(ready) == len(self.models) else "degraded" if ready else "unavailable"
        out = {"status": status, "models": {m: {"ready": ok} for m, ok in self.models.items()}}
        if self.draft is not None:
            out["draft"] = {"ready": self.draft}
        if self.error:
            out["error"] = self.error
        return out


def with_status(stats: dict) -> dict:
    """The router's stats with a verdict: `failing` (a target did not answer), `degraded` (the draft did not: rounds
    go target-only, requests still succeed) or `ok`, and the failing deployments."""
    bad = [n for n, t in stats["targets"].items() if "error" in t["deployment"]]
    if stats["draft"] is not None and "error" in stats["draft"]:
        bad.append("draft")
    status = "failing" if any(n != "draft" for n in bad) else "degraded" if bad else "ok"
    return {"status": status, "failing": bad, **stats}


def running_replicas(status, app: str) -> dict[str, int]:
    """deployment name -> RUNNING replicas, from a `serve.status()` answer."""
    application = status.applications.get(app)
    if application is None:
        return {}
    return {name: int(d.replica_states.get("RUNNING", 0)) for name, d in application.deployments.items()}


class ReadinessProbe:
    """Readiness of every model of one app; `deployments` maps a model to its target deployment's name (None: loaded
    in the router, ready while the router answers)."""

    def __init__(self, read_status: Callable[[], dict[str, int]], deployments: dict[str, str | None],
                 draft: str | None) -> None:
        self._read, self.deployments, self.draft = read_status, deployments, draft
        self._running: dict[str, int] | None = None
        self._at = self._tried = float("-inf")  # the last answer; the last call
        self._error: str | None = None
        self._lock = asyncio.Lock()

    async def check(self) -> Readiness:
        async with self._lock:  # concurrent probes share one controller call
            if time.monotonic() - self._tried > READY_TTL_S:
                await self._refresh()
        running = self._running or {}
        unknown = self._running is None
        models = {m: (d is None or (not unknown and running.get(d, 0) > 0)) for m, d in self.deployments.items()}
        draft = None if self.draft is None else (not unknown and running.get(self.draft, 0) > 0)
        return Readiness(models, draft, self._error if unknown else None)

    async def _refresh(self) -> None:
        self._tried = time.monotonic()
        try:
            self._running = await asyncio.wait_for(asyncio.to_thread(self._read), STATUS_TIMEOUT_S)
            self._at, self._error = time.monotonic(), None
        except Exception as exc:  # the controller is away: keep the last answer a while, then say unknown
            logger.warning("readiness: Serve controller status failed", exc_info=True)
            self._error = f"no answer from the Serve controller ({type(exc).__name__})"
            if time.monotonic() - self._at > STALE_AFTER_S:
                self._running = None


def serve_status_reader(app: str) -> Callable[[], dict[str, int]]:
    """RUNNING replicas per deployment of `app`, from Serve's public status API (a blocking controller call)."""

    def read() -> dict[str, int]:
        from ray import serve

        return running_replicas(serve.status(), app)

    return read
