"""Serve's request router for the draft and target deployments: ranks replicas for a call's `affinity` key the way
the calling router splits its rounds (`affinity.preferred_order`), so each sequence's rounds stay on the replica that
holds its KV. The request router runs in the caller's process and publishes the live replica set there
(`affinity.publish_replicas`), which is what lets the caller split a round into one call per preferred replica; calls
that meet on a replica still merge into one forward (`@serve.batch`).

Only Serve's public request-router API (`ray.serve.request_router`) is used; the ray versions it is tested with are
pinned in requirements.txt and bounded in pyproject.toml.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .affinity import preferred_order, publish_replicas, router_slot


def affinity_key(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None:
        return None
    key = pending_request.kwargs.get("affinity")
    return key if isinstance(key, str) else None


class SequenceAffinityRouter(RequestRouter):
    """Ranks replicas by the request's `affinity` key (`affinity.preferred_order`: the calling router's home
    replicas first, each group by rendezvous hashing of the key); calls without a key go to the least
    loaded replica (Serve probes queue lengths within each rank and skips full replicas), ties broken at random
    (Serve takes the first of equals: idle replicas would always get keyless calls in the same order)."""

    # A busy replica answers Serve's queue-length probe late on a loaded host (few cores, a draft forward in every
    # replica): with Serve's default deadline the home replica counts as unavailable and the next in the ranking takes
    # the call, rebuilding the sequence there. Waiting up to a second for the home replica is cheaper than recomputing
    # a prefix; a dead replica fails its probe at once.
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
        if replicas:  # the deployment, from its replicas' ids (public), kept for an update that empties it
            self._published = replicas[0].replica_id.deployment_id
        if getattr(self, "_published", None) is not None:
            publish_replicas(self._published, [r.replica_id.unique_id for r in replicas])


def affinity_router_config() -> dict[str, Any]:
    """`request_router_config` for the draft and target deployments."""
    return {"request_router_class": SequenceAffinityRouter}
