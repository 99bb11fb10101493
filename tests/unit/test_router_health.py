"""/stats with a dead or hung draft replica: the targets still serve, so the answer is "degraded", and it comes within
one deployment's stats timeout however many deployments there are (they are asked at once)."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from s2d_ray.serve import router as router_mod
from s2d_ray.serve import router_stats
from s2d_ray.serve.tenants import TenantKeys

# The ingress class's __del__ is a coroutine in Serve; the bare instances here never start it.
pytestmark = pytest.mark.filterwarnings("ignore:coroutine .*ASGIIngressWrapper.__del__:RuntimeWarning")


class _Handle:
    """A deployment handle whose stats answer after `delay_s` (None: never, as a killed replica Serve still routes to)."""

    def __init__(self, delay_s: float | None) -> None:
        self.stats = SimpleNamespace(remote=lambda: self._answer(delay_s))

    @staticmethod
    async def _answer(delay_s: float | None) -> dict:
        if delay_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(delay_s)
        return {"live_sequences": 0}


def _router(targets: dict[str, float | None], draft: float | None):
    cls = router_mod.Router.func_or_class
    self = object.__new__(cls)
    sched = SimpleNamespace(num_running=0, waiting=[], timing=lambda: {}, engine=SimpleNamespace(suffix=None))
    self.cfg = SimpleNamespace(uses_draft=True)
    self.adapters = SimpleNamespace(registry=None, base_of={})  # no LoRA targets: no registry to refresh
    self.replica = "r0"
    self.affinities = []
    self.schedulers = {name: sched for name in targets}
    self.target_handles = {name: _Handle(d) for name, d in targets.items()}
    self.draft_handle = _Handle(draft)
    self.tenants = TenantKeys([])  # no keys: the operator view is open
    return self


def _health(self) -> tuple[int, dict, float]:
    started = time.monotonic()
    resp = asyncio.run(self.stats_view(None))
    return resp.status_code, json.loads(resp.body), time.monotonic() - started


@pytest.fixture
def short_timeout(monkeypatch):
    monkeypatch.setattr(router_stats, "STATS_TIMEOUT_S", 0.3)  # each deployment's call
    monkeypatch.setattr(router_mod, "STATS_TIMEOUT_S", 0.3)  # and the router's bound on them all


def test_hung_draft_is_reported_not_fatal_and_bounded(short_timeout):
    # Three targets that each take most of the timeout: asked one after another (the old code) with the draft's wait
    # on top, this ran past the outer bound and reported a failure although every target answered.
    status, body, took = _health(_router({"a": 0.2, "b": 0.2, "c": 0.2}, draft=None))
    assert status == 200, body
    assert body["status"] == "degraded" and body["failing"] == ["draft"]
    assert "TimeoutError" in body["draft"]["error"]
    assert all("error" not in t["deployment"] for t in body["targets"].values())
    assert took < 0.3 * 2  # one timeout, not one per deployment


def test_hung_target_is_failing(short_timeout):
    status, body, _ = _health(_router({"a": 0.0, "b": None}, draft=0.0))
    assert status == 200 and body["status"] == "failing" and body["failing"] == ["b"]


def test_all_answering_is_ok(short_timeout):
    status, body, _ = _health(_router({"a": 0.0}, draft=0.0))
    assert status == 200 and body["status"] == "ok" and body["failing"] == []
