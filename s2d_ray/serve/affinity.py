"""Replica affinity: a sequence's rounds (propose, score, release) go to the replica that holds its KV.

Every sequence has its own routing key (the router's key and the sequence id), so a router's live sequences spread
over the replicas of each deployment while each sequence's rounds stay on one. Serve's request router for the draft
and target deployments ranks replicas by rendezvous hashing of a call's `affinity` key. A router's round is split
into one call per replica its sequences prefer (`affinity_keys.split_call`: the request router, which runs in the
caller's process, publishes the live replica set, so the caller ranks the same way); calls that meet on a replica, from one router or
several, still merge into one forward (`@serve.batch`). When the preferred replica is gone, draining, or its queue is
full, the next in the ranking takes the call and rebuilds the sequence from its token prefix (always correct; counted
as `s2d_recomputed_tokens_total`). The router clients' side (the keys, what an earlier round already computed) is
`scheduler.Affinity`. (One key per router, as before, left replicas idle with fewer routers than replicas and once put
two routers on the same draft replica.)
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import RequestRouter

from .affinity_keys import publish_replicas, rendezvous_rank


def affinity_key(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None:
        return None
    key = pending_request.kwargs.get("affinity")
    return key if isinstance(key, str) else None


class SequenceAffinityRouter(RequestRouter):
    """Ranks replicas by rendezvous hashing of the request's `affinity` key; calls without a key go to the least
    loaded replica (Serve probes queue lengths within each rank and skips full replicas), ties broken at random
    (Serve takes the first of equals: idle replicas would always get keyless calls in the same order)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every rank full: back off, don't spin
        key = affinity_key(pending_request)
        if key is None or len(candidate_replicas) < 2:
            return [random.sample(list(candidate_replicas), len(candidate_replicas))]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[rid]] for rid in rendezvous_rank(key, list(by_id))]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Also publishes the live set to this process's callers (`live_replicas`), so they split rounds the same
        way this router ranks."""
        super().update_replicas(replicas)
        publish_replicas(self._deployment_id, [r.replica_id.unique_id for r in replicas])


def affinity_router_config() -> dict[str, Any]:
    """`request_router_config` for the draft and target deployments."""
    return {"request_router_class": SequenceAffinityRouter}
