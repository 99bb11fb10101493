"""Bounded stats calls to the app's deployments, for the router's /stats, /metrics and handle `stats()`: a dead
replica is reported after STATS_TIMEOUT_S, never waited on.
"""

from __future__ import annotations

import asyncio

from .affinity import Affinity, each_replica

STATS_TIMEOUT_S = 5.0  # one deployment's stats call; a dead replica is reported after this, not waited on


async def call_stats(handle, key: str | None = None) -> dict:
    """A deployment's stats (the replica `key` is pinned to), or the error that prevented them (bounded: a dead
    replica must not hang /health)."""
    try:
        call = handle.stats.remote(affinity=key) if key else handle.stats.remote()
        return await asyncio.wait_for(_await(call), STATS_TIMEOUT_S)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


async def replica_stats(handle) -> list[dict]:
    """Every live replica's stats (the prefix cache counters live in each), the first one answered as before."""
    return await each_replica(handle, lambda key: call_stats(handle, key))


async def _await(response):
    return await response


def recomputed(affinities: list[Affinity]) -> dict[str, dict[str, int]]:
    """deployment -> replica -> tokens recomputed for one router's calls (s2d_recomputed_tokens_total)."""
    out: dict[str, dict[str, int]] = {}
    for aff in affinities:
        per_replica = out.setdefault(aff.deployment, {})
        for replica, n in aff.recomputed.items():
            per_replica[replica] = per_replica.get(replica, 0) + n
    return out
