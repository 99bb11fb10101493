"""Which replica a router's sequences go to, and how its round splits over replicas (no Ray)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from s2d_ray.serve.affinity import (
    home_replicas, preferred_order, publish_replicas, sequence_key, split_by_replica, split_call,
)

REPLICAS = ("r-a", "r-b")


def keys(router: str, n: int = 16) -> list[str]:
    return [sequence_key(router, f"seq{i}") for i in range(n)]


def test_one_router_spreads_its_sequences_over_all_replicas_each_call_keyed_to_land_there():
    ks = keys("router1")
    parts = split_by_replica(ks, REPLICAS)
    assert len(parts) == 2 and sorted(i for _, idx in parts for i in idx) == list(range(16))
    for key, idx in parts:
        assert {preferred_order(ks[i], list(REPLICAS))[0] for i in idx} == {preferred_order(key, list(REPLICAS))[0]}
    assert split_by_replica(ks, REPLICAS) == parts  # stable: a sequence's rounds keep their replica


def test_as_many_routers_as_replicas_each_keeps_whole_rounds_on_its_own_replica():
    """Two routers (ranks 0 and 1) never share a replica, whatever their keys; each round stays one call."""
    for router in ("a", "b", "c", "d"):
        first = split_by_replica(keys(router), REPLICAS, (0, 2))
        second = split_by_replica(keys(router + "x"), REPLICAS, (1, 2))
        assert [idx for _, idx in first] == [list(range(16))] == [idx for _, idx in second]
        assert preferred_order(first[0][0], list(REPLICAS), 0, 2)[0] == "r-a"
        assert preferred_order(second[0][0], list(REPLICAS), 1, 2)[0] == "r-b"
    # three routers, two replicas: one to each, the third shares; two routers, four replicas: two each
    assert [home_replicas(list(REPLICAS), r, 3) for r in range(3)] == [["r-a"], ["r-b"], ["r-a"]]
    four = ["r1", "r2", "r3", "r4"]
    assert [home_replicas(four, r, 2) for r in range(2)] == [["r1", "r3"], ["r2", "r4"]]
    assert set(preferred_order("k", four, 1, 2)[:2]) == {"r2", "r4"}  # the others stay as fallbacks


def test_unknown_replicas_one_call_per_key_and_local_handles_one_call():
    ks = [sequence_key("r", s) for s in ("x", "y", "z")]
    assert split_by_replica(ks, ()) == [(k, [i]) for i, k in enumerate(ks)]
    assert split_by_replica(ks, None) == [(ks[0], [0, 1, 2])]
    assert split_by_replica(ks, ("only",)) == [(ks[0], [0, 1, 2])]
    assert split_by_replica([None, None], REPLICAS) == [(None, [0, 1])]
    assert split_by_replica([], REPLICAS) == []


def test_split_call_uses_the_replicas_the_request_router_published():
    handle = SimpleNamespace(deployment_id=SimpleNamespace(app_name="app", name="draft"))
    ks = keys("router1", 8)
    calls = []

    async def call(idx, key):
        calls.append((key, idx))
        return idx

    assert len(asyncio.run(split_call(handle, ks, call))) == 8  # nothing published yet: one call per key
    publish_replicas(handle.deployment_id, list(REPLICAS))
    calls.clear()
    parts = asyncio.run(split_call(handle, ks, call))  # outside a Serve replica: router 0 of 1, both replicas
    assert [idx for idx, _ in parts] == [idx for _, idx in split_by_replica(ks, REPLICAS)] and len(calls) == 2
