"""Replica affinity: a sequence's rounds (propose, score, release) go to the replica that holds its KV. No Ray at
import (the router's clients and scheduler use this; the Serve request router is `affinity_router`).

Each sequence's key is its router's key plus its sequence id. Router replica r of n (Serve's replica rank and world
size) has home replicas among a deployment's R live replicas (sorted ids): replica r mod R when n >= R (routers spread
one to a replica: each keeps whole rounds, so forwards stay as large as its batch), else every replica j with
j mod n == r (one router's sequences spread over the replicas no other router has). A sequence prefers the home
replica its key ranks highest by rendezvous hashing, then the others by the same hash (`preferred_order`, also what
`affinity_router.SequenceAffinityRouter` ranks each call by). A round is one call per preferred replica, each call
carrying a key of one of its members (all prefer that replica). When the preferred replica is gone, draining, or its
queue is full, the next in the ranking takes the call and rebuilds the sequence from its token prefix (always correct;
counted as `s2d_recomputed_tokens_total`).

Why not one key per router: hashed onto replicas, replicas idle with fewer routers than replicas and two routers can
land on one replica. Why not every sequence hashed over all replicas: each router's batch would split over replicas
other routers also use, so forwards carry fewer rows (RELIABILITY.md, "Scaling out").
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any, Awaitable, Callable

from ..core.stack import common_prefix


def rendezvous_rank(key: str, replica_ids: list[str]) -> list[str]:
    """Replica ids, most preferred first (highest random weight): adding or removing a replica moves only the keys
    that preferred it."""
    def weight(rid: str) -> bytes:
        return hashlib.blake2b(f"{key}|{rid}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


def home_replicas(replica_ids: list[str], rank: int, routers: int) -> list[str]:
    """The replicas router `rank` of `routers` keeps its sequences on (see the module docstring)."""
    ids = sorted(replica_ids)
    if not ids:
        return []
    if routers >= len(ids):
        return [ids[rank % len(ids)]]
    return [rid for j, rid in enumerate(ids) if j % routers == rank % routers]


def preferred_order(key: str, replica_ids: list[str], rank: int = 0, routers: int = 1) -> list[str]:
    """Replica ids, most preferred first: the router's home replicas by rendezvous hashing of the key, then the rest."""
    home = home_replicas(replica_ids, rank, routers)
    return rendezvous_rank(key, home) + rendezvous_rank(key, [r for r in replica_ids if r not in home])


def router_slot() -> tuple[int, int]:
    """(rank, world size) of this process's Serve replica (a router replica); (0, 1) outside a replica."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
    except Exception:  # not inside a Serve replica (tests, a driver)
        return 0, 1
    rank = getattr(ctx.rank, "rank", ctx.rank)
    return int(rank or 0), max(int(getattr(ctx, "world_size", 1) or 1), 1)


# (app, deployment) -> live replica ids, as this process's request routers last saw them
_LIVE: dict[tuple[str, str], tuple[str, ...]] = {}


def publish_replicas(deployment_id: Any, replica_ids: list[str]) -> None:
    """Called by `affinity_router.SequenceAffinityRouter` whenever Serve updates its replica set."""
    _LIVE[(deployment_id.app_name, deployment_id.name)] = tuple(sorted(replica_ids))


def live_replicas(handle: Any) -> tuple[str, ...] | None:
    """The replica ids the handle's request router last saw (() before its first update); None for a handle that
    is not a Serve deployment handle (tests' local stand-ins: one call, as one replica)."""
    dep = getattr(handle, "deployment_id", None)
    return None if dep is None else _LIVE.get((dep.app_name, dep.name), ())


def sequence_key(router_key: str | None, seq_id: str) -> str | None:
    return None if router_key is None else f"{router_key}/{seq_id}"


def split_by_replica(keys: list[str | None], replica_ids: tuple[str, ...] | None,
                     slot: tuple[int, int] = (0, 1)) -> list[tuple[str | None, list[int]]]:
    """Request indices grouped by the replica their keys prefer (router `slot` = (rank, routers)), each group with a
    key that prefers it (its first member's). Replicas not known yet: one group per key (the request router places
    each call); no keys or one replica: one group."""
    if not keys:
        return []
    if replica_ids is None or len(replica_ids) == 1 or any(k is None for k in keys):
        return [(keys[0], list(range(len(keys))))]
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        where = preferred_order(key, list(replica_ids), *slot)[0] if replica_ids else key
        groups.setdefault(where, []).append(i)
    return [(keys[idx[0]], idx) for idx in groups.values()]


async def split_call(handle: Any, keys: list[str | None],
                     call: Callable[[list[int], str | None], Awaitable[Any]]) -> list[tuple[list[int], Any]]:
    """`call(indices, key)` once per replica the requests' keys prefer, concurrently: (indices, reply) per call."""
    replicas = live_replicas(handle)
    parts = split_by_replica(keys, replicas, router_slot() if replicas else (0, 1))
    replies = await asyncio.gather(*(call(idx, key) for key, idx in parts))
    return [(idx, reply) for (_, idx), reply in zip(parts, replies)]


class Affinity:
    """A router client's side of affinity for one deployment: the router's routing key (each sequence's key is it
    plus the sequence id, `key_for`), and per live sequence the tokens whose KV the deployment computed in the last
    successful round. `expected` is how many of a new call's leading tokens that covers (what the replica holds if
    nothing moved); `record` counts what a replica reported recomputing into
    `s2d_recomputed_tokens_total{deployment, replica}` (each call counted once, by its caller)."""

    def __init__(self, key: str | None, deployment: str, counter: Any = None) -> None:
        self.key, self.deployment, self.counter = key, deployment, counter
        self.recomputed: dict[str, int] = {}  # replica -> tokens it recomputed for this client's calls
        self._tokens: dict[str, list[int]] = {}

    def key_for(self, seq_id: str) -> str | None:
        return sequence_key(self.key, seq_id)

    def gathered(self, parts: list[tuple[list[int], Any]], n: int) -> list:
        """The results of a round split over replicas (`split_call`), in request order; each call's recomputed
        tokens recorded against the replica that answered it."""
        out: list = [None] * n
        for idx, reply in parts:
            self.record(reply.recomputed, reply.replica)
            for i, result in zip(idx, reply.results):
                out[i] = result
        return out

    def expected(self, seq_id: str, tokens: list[int]) -> int:
        done = self._tokens.get(seq_id)
        return 0 if done is None else common_prefix(done, tokens)

    def computed(self, seq_id: str, tokens: list[int]) -> None:
        self._tokens[seq_id] = list(tokens)

    def forget(self, seq_id: str) -> None:
        self._tokens.pop(seq_id, None)

    def record(self, recomputed: int, replica: str) -> None:
        self.recomputed[replica] = self.recomputed.get(replica, 0) + recomputed
        if self.counter is not None:
            self.counter.labels(self.deployment, replica).inc(recomputed)
