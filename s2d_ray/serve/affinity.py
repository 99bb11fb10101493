"""Replica affinity: a sequence's rounds (propose, score, release) go to the replica that holds its KV.

Every sequence has its own routing key (the router's key and the sequence id), and each router replica has home
replicas in each deployment, from its Serve rank among the routers (`affinity_keys`): one replica each while there
are at least as many routers as replicas, else a share of them. So routers spread over the replicas, one router's
live sequences spread over its home replicas, and each sequence's rounds stay on one. Serve's request router for the
draft and target deployments ranks replicas for a call's `affinity` key that way. A router's round is one call per
replica its sequences prefer (`affinity_keys.split_call`: the request router runs in the caller's process and
publishes the live replica set, so the caller ranks the same way); calls that meet on a replica still merge into one
forward (`@serve.batch`). When the preferred replica is gone, draining, or its queue is full, the next in the ranking
takes the call and rebuilds the sequence from its token prefix (always correct; counted as
`s2d_recomputed_tokens_total`). The router clients' side (the keys, what an earlier round already computed) is
`scheduler.Affinity`.

Before: one key per router, hashed onto replicas: replicas idled with fewer routers than replicas, and two routers
hashed to the same draft replica in two of four measured runs. Hashing every sequence over all replicas instead
would split each router's batch over replicas other routers also use: forwards of half the rows (RELIABILITY.md).
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import RequestRouter

from .affinity_keys import preferred_order, publish_replicas, router_slot


def affinity_key(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None:
        return None
    key = pending_request.kwargs.get("affinity")
    return key if isinstance(key, str) else None


class SequenceAffinityRouter(RequestRouter):
    """Ranks replicas by the request's `affinity` key (`affinity_keys.preferred_order`: the calling router's home
    replicas first, each group by rendezvous hashing of the key); calls without a key go to the least
    loaded replica (Serve probes queue lengths within each rank and skips full replicas), ties broken at random
    (Serve takes the first of equals: idle replicas would always get keyless calls in the same order)."""

    # A busy replica answers Serve's queue-length probe late on a loaded host (two cores, a draft forward in every
    # replica): with Serve's 0.1 s deadline the home replica counted as unavailable and the next in the ranking took
    # the call, rebuilding the sequence there (6 such misses in the one failing tests/serve run of session 22). Waiting
    # up to a second for the home replica is cheaper than recomputing a prefix; a dead replica fails its probe at once.
    queue_len_response_deadline_s = 1.0
    max_queue_len_response_deadline_s = 2.0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every rank full: back off, don't spin
        key = affinity_key(pending_request)
        if key is None or len(candidate_replicas) < 2:
            return [random.sample(list(candidate_replicas), len(candidate_replicas))]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[rid]] for rid in preferred_order(key, list(by_id), *router_slot())]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Also publishes the live set to this process's callers (`live_replicas`), so they split rounds the same
        way this router ranks."""
        super().update_replicas(replicas)
        publish_replicas(self._deployment_id, [r.replica_id.unique_id for r in replicas])


def affinity_router_config() -> dict[str, Any]:
    """`request_router_config` for the draft and target deployments."""
    return {"request_router_class": SequenceAffinityRouter}
