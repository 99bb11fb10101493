"""Routing keys and how a round splits over replicas, without Ray (the router's scheduler imports this).

Each sequence's key is its router's key plus its sequence id; a replica is preferred by rendezvous hashing of the key
over the live replica ids, the same ranking `affinity.SequenceAffinityRouter` applies to each call. A round is split
into one call per preferred replica, each call carrying a key of one of its members (all prefer that replica).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any, Awaitable, Callable


def rendezvous_rank(key: str, replica_ids: list[str]) -> list[str]:
    """Replica ids, most preferred first (highest random weight): adding or removing a replica moves only the keys
    that preferred it."""
    def weight(rid: str) -> bytes:
        return hashlib.blake2b(f"{key}|{rid}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


_LIVE: dict[tuple[str, str], tuple[str, ...]] = {}  # (app, deployment) -> live replica ids, seen by this process


def publish_replicas(deployment_id: Any, replica_ids: list[str]) -> None:
    """Called by the request router (`affinity.SequenceAffinityRouter`) whenever Serve updates its replica set."""
    _LIVE[(deployment_id.app_name, deployment_id.name)] = tuple(sorted(replica_ids))


def live_replicas(handle: Any) -> tuple[str, ...] | None:
    """The replica ids the handle's request router last saw (() before its first update); None for a handle that
    is not a Serve deployment handle (tests' local stand-ins: one call, as one replica)."""
    dep = getattr(handle, "deployment_id", None)
    return None if dep is None else _LIVE.get((dep.app_name, dep.name), ())


def sequence_key(router_key: str | None, seq_id: str) -> str | None:
    return None if router_key is None else f"{router_key}/{seq_id}"


def split_by_replica(keys: list[str | None], replica_ids: tuple[str, ...] | None) -> list[tuple[str | None, list[int]]]:
    """Request indices grouped by the replica their keys prefer, each group with a key that prefers it (its first
    member's). Replicas not known yet: one group per key (the request router places each call); no keys or one
    replica: one group."""
    if not keys:
        return []
    if replica_ids is None or len(replica_ids) == 1 or any(k is None for k in keys):
        return [(keys[0], list(range(len(keys))))]
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(rendezvous_rank(key, list(replica_ids))[0] if replica_ids else key, []).append(i)
    return [(keys[idx[0]], idx) for idx in groups.values()]


async def split_call(handle: Any, keys: list[str | None],
                     call: Callable[[list[int], str | None], Awaitable[Any]]) -> list[tuple[list[int], Any]]:
    """`call(indices, key)` once per replica the requests' keys prefer, concurrently: (indices, reply) per call."""
    parts = split_by_replica(keys, live_replicas(handle))
    replies = await asyncio.gather(*(call(idx, key) for key, idx in parts))
    return [(idx, reply) for (_, idx), reply in zip(parts, replies)]
