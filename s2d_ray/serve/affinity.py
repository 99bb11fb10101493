"""Replica affinity: a sequence's rounds (propose, score, release) go to the replica that holds its KV.

Every call from a router's engine carries an `affinity` key (the router's own, stable for its lifetime). Serve's
request router for the draft and target deployments ranks replicas by rendezvous hashing of that key, so one router's
rounds keep landing on one replica of each deployment, while different routers spread over the replicas; calls that
meet on a replica still merge into one forward (`@serve.batch`). When the preferred replica is gone, draining, or its
queue is full, the next in the ranking takes the call and rebuilds the sequence from its token prefix (always
correct; counted as `s2d_recomputed_tokens_total`). The router clients' side (the key, what an earlier round already
computed) is `scheduler.Affinity`, which needs no Ray.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import RequestRouter


def rendezvous_rank(key: str, replica_ids: list[str]) -> list[str]:
    """Replica ids, most preferred first (highest random weight): adding or removing a replica moves only the keys
    that preferred it."""
    def weight(rid: str) -> bytes:
        return hashlib.blake2b(f"{key}|{rid}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


def affinity_key(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None:
        return None
    key = pending_request.kwargs.get("affinity")
    return key if isinstance(key, str) else None


class SequenceAffinityRouter(RequestRouter):
    """Ranks replicas by rendezvous hashing of the request's `affinity` key; calls without a key go to the least
    loaded replica (Serve probes queue lengths within each rank and skips full replicas)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every rank full: back off, don't spin
        key = affinity_key(pending_request)
        if key is None or len(candidate_replicas) < 2:
            return [list(candidate_replicas)]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[rid]] for rid in rendezvous_rank(key, list(by_id))]


def affinity_router_config() -> dict[str, Any]:
    """`request_router_config` for the draft and target deployments."""
    return {"request_router_class": SequenceAffinityRouter}
