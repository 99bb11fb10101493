"""A target replica lost mid-round: the router's client resends that replica's share of the round to whichever replica
answers, which rebuilds the sequences from their tokens, so every stream goes on with exactly the target's greedy
tokens; past `failover_s` the requests end with a 503 that carries Retry-After. Real clients and scheduler over
in-process tiny float64 models; the loss is Ray's own exception (what a call to a replica on a dead node raises).
The multi-node version (a real raylet killed) is tests/cluster/test_cluster_node_loss.py."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from core_fixtures import random_prompts, tiny_target
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.policy import FixedK
from s2d_ray.core.target import TargetVerifier
from s2d_ray.errors import ServiceUnavailableError
from s2d_ray.serve.clients import TargetClient, TargetGoneError, replica_lost
from s2d_ray.serve.http_api import api_error, error_response
from s2d_ray.serve.metrics import ServeMetrics
from s2d_ray.serve.scheduler import TargetScheduler
from s2d_ray.serve.tp import TPGroupError, TPRequestError
from test_scheduler import TargetReplica, collect

NEW_TOKENS = 24


class TwoReplicas:
    """A handle over two target replicas: calls go to the first until it is `lost` (every call to it then raises
    what Ray raises for a dead actor), then to the second, which starts with no KV of any sequence."""

    deployment_id = None  # not a Serve handle: no replica set to read

    def __init__(self, target, lose_after_calls: int | None, error=ActorDiedError) -> None:
        self.replicas = [TargetReplica(TargetVerifier(target)), TargetReplica(TargetVerifier(target))]
        self.lose_after_calls, self.error = lose_after_calls, error
        self.calls = 0

    def __getattr__(self, name: str):
        async def call(*args, **kwargs):
            await asyncio.sleep(0)
            first_lost = self.lose_after_calls is not None and self.calls >= self.lose_after_calls
            if name == "score":
                self.calls += 1
                if first_lost and self.calls == self.lose_after_calls + 1:
                    raise self.error()  # the call in flight when the node died
            replica = self.replicas[1] if first_lost else self.replicas[0]
            return getattr(replica, name)(*args, **kwargs)

        return SimpleNamespace(remote=call)


class NoReplica:
    """A handle whose every call fails as a call to a replica on a dead node does, and no replica comes back."""

    deployment_id = None

    def __getattr__(self, name: str):
        async def call(*args, **kwargs):
            await asyncio.sleep(0)
            raise ActorUnavailableError("the node died", None)

        return SimpleNamespace(remote=call)


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=3)


@pytest.fixture(scope="module")
def prompts_and_expected(target):
    prompts = random_prompts(4, seed=11)
    out = SpecEngine(TargetVerifier(target)).generate(
        [GenerationRequest(f"r{i}", p, NEW_TOKENS) for i, p in enumerate(prompts)])
    return prompts, [r.token_ids for r in out]


def run_four(handle, failover_s: float) -> tuple[list, ServeMetrics]:
    """Four concurrent requests through a real scheduler whose verifier is the client over `handle`."""
    metrics = ServeMetrics()
    client = TargetClient(handle, "t", timeout_s=30.0, failover_s=failover_s,
                          on_failover=metrics.target_failovers.labels("t").inc)
    sched = TargetScheduler("t", SpecEngine(client, None, policy=FixedK(3)), 4, 4, metrics)

    async def main(prompts):
        try:
            queues = [sched.submit(GenerationRequest(f"s{i}", p, NEW_TOKENS)) for i, p in enumerate(prompts)]
            return await asyncio.gather(*(collect(q) for q in queues))
        finally:
            sched.task.cancel()

    return main, metrics


def test_a_lost_replicas_round_is_resent_and_every_stream_stays_exact(target, prompts_and_expected):
    prompts, expected = prompts_and_expected
    handle = TwoReplicas(target, lose_after_calls=3)
    main, metrics = run_four(handle, failover_s=10.0)
    results = asyncio.run(main(prompts))
    for (tokens, ev), want in zip(results, expected):
        assert ev.error is None and ev.finish_reason == "length"
        assert tokens == want  # not ended early, nothing repeated or skipped
    assert handle.replicas[1].batches, "the survivor took the rounds after the loss"
    assert metrics.target_failovers.labels("t")._value.get() == 1
    # The survivor rebuilt every sequence from its tokens: its first call says what earlier calls had computed.
    assert all(n > 0 for n in handle.replicas[1].seen[0].values())


def test_without_failover_the_lost_round_fails_its_requests(target, prompts_and_expected):
    """Negative control: failover_s 0 (no resend), and the scheduler's one-by-one retry hits the loss too."""
    prompts, _ = prompts_and_expected
    handle = TwoReplicas(target, lose_after_calls=3, error=lambda: TPGroupError("rank 1 died"))
    handle.replicas[1] = NoReplica()
    main, _ = run_four(handle, failover_s=0.0)
    results = asyncio.run(main(prompts))
    assert all(isinstance(ev.error, ServiceUnavailableError) for _, ev in results)


def test_no_replica_within_the_bound_is_a_503_with_retry_after(target, prompts_and_expected):
    prompts, _ = prompts_and_expected
    main, metrics = run_four(NoReplica(), failover_s=1.0)
    start = time.monotonic()
    results = asyncio.run(main(prompts))
    assert time.monotonic() - start < 10.0  # bounded: not one failover_s per sequence either
    for _, ev in results:
        assert isinstance(ev.error, TargetGoneError)
        resp = error_response(api_error(ev.error))
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert metrics.target_failovers.labels("t")._value.get() >= 1


def test_only_a_lost_replica_is_resent_not_a_bad_request():
    assert replica_lost(ActorDiedError()) and replica_lost(ActorUnavailableError("x", None))
    assert replica_lost(TPGroupError("rank 1: collective failed"))
    assert not replica_lost(TPRequestError("every rank refused"))  # the request's own fault: resending repeats it
    assert not replica_lost(RuntimeError("bad input"))
    assert not replica_lost(asyncio.TimeoutError())


def test_a_slow_replica_times_out_without_a_resend(target, prompts_and_expected):
    """A replica that is alive but slower than timeout_s: a TargetTimeoutError after one call, not a failover."""
    from s2d_ray.serve.clients import TargetTimeoutError

    calls = []

    class Slow:
        deployment_id = None

        def __getattr__(self, name: str):
            async def call(*args, **kwargs):
                calls.append(name)
                await asyncio.sleep(5.0)

            return SimpleNamespace(remote=call)

    prompts, _ = prompts_and_expected
    client = TargetClient(Slow(), "t", timeout_s=0.2, failover_s=30.0)
    sched = TargetScheduler("t", SpecEngine(client, None, policy=FixedK(3)), 4, 4, ServeMetrics())

    async def main():
        try:
            return await collect(sched.submit(GenerationRequest("s0", prompts[0], NEW_TOKENS)))
        finally:
            sched.task.cancel()

    _, ev = asyncio.run(main())
    assert isinstance(ev.error, TargetTimeoutError) and calls.count("score") == 1
