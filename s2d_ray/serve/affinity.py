"""Replica affinity: a sequence's rounds (propose, score, release) go to the replica that holds its KV.

Every call from a router's engine carries an `affinity` key (the router's own, stable for its lifetime). Serve's
request router for the draft and target deployments ranks replicas by rendezvous hashing of that key, so one router's
rounds keep landing on one replica of each deployment, while different routers spread over the replicas; calls that
meet on a replica still merge into one forward (`@serve.batch`). When the preferred replica is gone, draining, or its
queue is full, the next in the ranking takes the call and rebuilds the sequence from its token prefix (always
correct; counted as `s2d_recomputed_tokens_total`). `Affinity` is a router client's side: the key, and what an
earlier round already computed, sent with each call so the replica can tell a recompute from new work.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import RequestRouter

from ..core.stack import common_prefix


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


class Affinity:
    """A router client's side of affinity for one deployment: the routing key its calls carry, and per live sequence
    the tokens whose KV the deployment computed in the last successful round. `expected` is how many of a new call's
    leading tokens that covers (what the replica holds if nothing moved); `record` counts what a replica reported
    recomputing into `s2d_recomputed_tokens_total{deployment, replica}` (each call counted once, by its caller)."""

    def __init__(self, key: str | None, deployment: str, counter: Any = None) -> None:
        self.key, self.deployment, self.counter = key, deployment, counter
        self.recomputed: dict[str, int] = {}  # replica -> tokens it recomputed for this client's calls
        self._tokens: dict[str, list[int]] = {}

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
