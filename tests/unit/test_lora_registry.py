"""The adapter registry's bookkeeping and a router's copy of it, without Ray: claims, commits and unloads, when an
unload counts as drained, what a starting replica registers, and when a router fetches a new copy."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from s2d_ray.serve import lora_registry
from s2d_ray.serve.app_config import AppConfig
from s2d_ray.serve.lora import RouterAdapters
from s2d_ray.serve.lora_registry import AdapterRegistry, AdapterSync


def test_claims_commits_and_unloads():
    reg = AdapterRegistry()
    assert reg.claim("y", "base", "/y") is None
    assert "already served" in reg.claim("y", "base", "/y2")  # a load under way holds the name
    assert reg.for_base("base") == {"load": {"y": "/y"}, "unload": []}  # a replica starting now registers it
    reg.release("y")
    assert reg.for_base("base")["load"] == {} and reg.claim("y", "base", "/y") is None
    v = reg.commit("y")
    assert reg.sync("r1", [])["loaded"] == {"y": "base"} and v == 1
    assert "already served" in reg.claim("y", "base", "/y")
    reg.retire("y", "base")
    reg.retire("x", "base")  # a configured adapter: new replicas forget it
    assert reg.sync("r1", [])["loaded"] == {} and reg.for_base("base") == {"load": {}, "unload": ["x"]}
    assert reg.for_base("other") == {"load": {}, "unload": []}


def test_drained_waits_for_every_live_router(monkeypatch):
    reg = AdapterRegistry()
    reg.claim("y", "base", "/y")
    reg.commit("y")
    reg.sync("r1", ["y"])
    reg.sync("r2", [])
    v = reg.retire("y", "base")
    assert not reg.drained("y", v)  # neither router has fetched the unload yet
    reg.sync("r2", [])
    assert not reg.drained("y", v)  # r1 has not
    reg.sync("r1", ["y"])
    assert not reg.drained("y", v)  # r1 knows, but still runs a request of it
    reg.sync("r1", [])
    assert reg.drained("y", v)
    v = reg.retire("x", "base")
    monkeypatch.setattr(lora_registry, "ROUTER_STALE_S", -1.0)  # both routers gone: nobody to wait for
    assert reg.drained("x", v)


def cfg() -> AppConfig:
    return AppConfig.model_validate({"targets": [{"name": "smollm2-135m-instruct", "dtype": "float32",
                                                  "lora": {"adapters": {"gsm": "smollm2-135m-gsm8k"}}}]})


def test_a_copy_serves_runtime_loads_and_drops_unloads():
    forgotten: list[str] = []
    adapters = RouterAdapters(cfg(), object(), forgotten.append)
    models = {"smollm2-135m-instruct": _Info("smollm2-135m-instruct"), "gsm": _Info("gsm")}
    adapters.apply(models, {"y": "smollm2-135m-instruct"}, {})
    assert adapters.base_of == {"gsm": "smollm2-135m-instruct", "y": "smollm2-135m-instruct"}
    assert models["y"].name == "y"
    adapters.apply(models, {}, {})  # y unloaded elsewhere; the configured one stays
    assert set(models) == {"smollm2-135m-instruct", "gsm"} and forgotten == ["y"]
    adapters.apply(models, {}, {"gsm": "smollm2-135m-instruct"})  # a configured adapter unloaded elsewhere
    assert set(models) == {"smollm2-135m-instruct"} and forgotten == ["y", "gsm"]


@dataclass
class _Info:
    name: str


class _Registry:
    """The registry's `sync` as a handle would call it, counting calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.loaded: dict[str, str] = {}
        outer = self

        class _Method:
            async def remote(self, router, in_use):
                outer.calls += 1
                await asyncio.sleep(0.01)
                return {"epoch": "e", "version": outer.calls, "loaded": dict(outer.loaded), "removed": {}}

        self.sync = _Method()


def test_a_router_fetches_for_an_unknown_name_or_a_stale_runtime_copy(monkeypatch):
    async def run():
        reg, applied = _Registry(), []
        sync = AdapterSync(reg, "r1", lambda loaded, removed: applied.append(dict(loaded)), set)
        reg.loaded = {"y": "base"}
        await sync.ensure("y", False)  # unknown here: loaded through another router?
        assert reg.calls == 1 and applied[-1] == {"y": "base"}
        await sync.ensure("y", True)
        assert reg.calls == 1  # a fresh copy serves it
        monkeypatch.setattr(lora_registry, "VIEW_TTL_S", -1.0)
        await sync.ensure("y", True)
        assert reg.calls == 2  # a stale copy is fetched again before the request is admitted
        calls = reg.calls
        await asyncio.gather(*(sync.refresh() for _ in range(5)))
        assert calls < reg.calls <= calls + 2  # concurrent callers share fetches
        sync._loop.cancel()

    asyncio.run(run())


def test_runtime_loads_on_a_target_in_the_router_need_one_router():
    """Each router holds its own copy of a target placed in it: a runtime load there with several router replicas
    is a 400 (the registry could not reach the other routers' models); one router replica may load."""
    import pytest

    from s2d_ray.serve.http_api import ApiError
    from s2d_ray.serve.lora import _shared_or_one_router

    def router(replicas: int, registry):
        cfg = AppConfig.model_validate({
            "targets": [{"name": "smollm2-135m-instruct", "dtype": "float32", "placement": "router",
                         "lora": {"adapters": {"gsm": "smollm2-135m-gsm8k"}}}],
            "router": {"num_replicas": replicas}})
        return type("Router", (), {"cfg": cfg, "adapters": RouterAdapters(cfg, registry)})()

    with pytest.raises(ApiError) as err:
        _shared_or_one_router(router(2, object()), "smollm2-135m-instruct")
    assert err.value.status == 400 and "single router replica" in str(err.value)
    _shared_or_one_router(router(1, object()), "smollm2-135m-instruct")
    _shared_or_one_router(router(2, object()), None)  # the base is not known yet: checked again once it is
    with pytest.raises(ApiError):
        _shared_or_one_router(router(2, None), None)  # no registry: every load needs one router
