"""How a router's round splits over replicas by per-sequence affinity keys (no Ray)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from s2d_ray.serve.affinity_keys import publish_replicas, rendezvous_rank, sequence_key, split_by_replica, split_call

REPLICAS = ("r-a", "r-b")


def test_sequences_spread_over_replicas_each_group_keyed_by_a_member_that_prefers_it():
    keys = [sequence_key("router1", f"seq{i}") for i in range(16)]
    parts = split_by_replica(keys, REPLICAS)
    assert len(parts) == 2 and sorted(i for _, idx in parts for i in idx) == list(range(16))
    for key, idx in parts:
        preferred = {rendezvous_rank(keys[i], list(REPLICAS))[0] for i in idx}
        assert preferred == {rendezvous_rank(key, list(REPLICAS))[0]}  # the call lands where all its members live
    assert split_by_replica(keys, REPLICAS) == parts  # stable: a sequence's rounds keep their replica


def test_unknown_replicas_one_call_per_key_and_local_handles_one_call():
    keys = [sequence_key("r", s) for s in ("x", "y", "z")]
    assert split_by_replica(keys, ()) == [(k, [i]) for i, k in enumerate(keys)]
    assert split_by_replica(keys, None) == [(keys[0], [0, 1, 2])]
    assert split_by_replica(keys, ("only",)) == [(keys[0], [0, 1, 2])]
    assert split_by_replica([None, None], REPLICAS) == [(None, [0, 1])]
    assert split_by_replica([], REPLICAS) == []


def test_split_call_uses_the_replicas_the_request_router_published():
    handle = SimpleNamespace(deployment_id=SimpleNamespace(app_name="app", name="draft"))
    keys = [sequence_key("router1", f"seq{i}") for i in range(8)]
    calls = []

    async def call(idx, key):
        calls.append((key, idx))
        return idx

    assert len(asyncio.run(split_call(handle, keys, call))) == 8  # nothing published yet: one call per key
    publish_replicas(handle.deployment_id, list(REPLICAS))
    calls.clear()
    parts = asyncio.run(split_call(handle, keys, call))
    assert [idx for idx, _ in parts] == [idx for _, idx in split_by_replica(keys, REPLICAS)] and len(calls) == 2
