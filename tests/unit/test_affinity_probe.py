"""The affinity router waits for a busy home replica's queue length instead of passing the call on (Serve's request
router machinery, no cluster)."""

from __future__ import annotations

import asyncio

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
from ray.serve._private.request_router.request_router import RequestRouter

from s2d_ray.serve.affinity_router import SequenceAffinityRouter

BUSY_S = 0.3  # a loaded replica's probe answer: over Serve's 0.1 s default, under ours


class SlowReplica:
    """Answers the queue-length probe after `BUSY_S`, as a replica does while its host is busy."""

    max_ongoing_requests = 256

    def __init__(self, name: str, deployment: DeploymentID):
        self.replica_id = ReplicaID(unique_id=name, deployment_id=deployment)

    async def get_queue_len(self, *, deadline_s: float) -> int:
        await asyncio.sleep(BUSY_S)
        return 0


def probe_choice(router_class: type) -> ReplicaID | None:
    deployment = DeploymentID(name="draft", app_name="probe")

    async def run() -> ReplicaID | None:
        router = router_class(deployment, DeploymentHandleSource.UNKNOWN)
        home = SlowReplica("home", deployment)
        router._replicas = {home.replica_id: home}
        chosen = await router._select_from_candidate_replicas([home], backoff_index=0)
        return None if chosen is None else chosen.replica_id

    return asyncio.run(run())


def test_busy_home_replica_keeps_the_call():
    assert probe_choice(SequenceAffinityRouter) == ReplicaID("home", DeploymentID(name="draft", app_name="probe"))


def test_serve_default_deadline_would_pass_the_call_on():
    """Serve's default deadline: the same busy replica counts as unavailable (the next rank takes the call)."""

    class DefaultDeadline(SequenceAffinityRouter):
        queue_len_response_deadline_s = RequestRouter.queue_len_response_deadline_s
        max_queue_len_response_deadline_s = RequestRouter.max_queue_len_response_deadline_s

    assert RequestRouter.queue_len_response_deadline_s < BUSY_S
    assert probe_choice(DefaultDeadline) is None
