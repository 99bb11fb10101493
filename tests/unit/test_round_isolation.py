"""A failed verification round fails only the sequence that caused it: the router's scheduler retries the round one
sequence at a time, so the others of the batch finish with exactly the target's greedy tokens (float64)."""

from __future__ import annotations

import asyncio

import pytest

from core_fixtures import noisy_draft, random_prompts, tiny_target
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.policy import FixedK
from s2d_ray.core.target import TargetVerifier
from s2d_ray.serve.metrics import ServeMetrics
from s2d_ray.serve.scheduler import ServiceUnavailableError, TargetScheduler, TargetTimeoutError
from test_engine_exact import reference_greedy

N_TOKENS = 12


class FlakyVerifier:
    """Scores with the tiny target, but a batch holding `poison` fails as a failed deployment call does, and the
    first `transient` calls fail whatever they hold (a replica that died mid-round)."""

    def __init__(self, verifier: TargetVerifier, poison: str | None = None, transient: int = 0,
                 error: type[Exception] = ServiceUnavailableError) -> None:
        self.verifier, self.poison, self.transient, self.error = verifier, poison, transient, error
        self.calls = 0

    async def score(self, requests):
        self.calls += 1
        if self.calls <= self.transient or any(r.seq_id == self.poison for r in requests):
            raise self.error("target tiny failed: ValueError")
        return self.verifier.score(requests)

    def release(self, seq_id: str) -> None:
        self.verifier.release(seq_id)


async def serve_all(verifier: FlakyVerifier, drafter: SortedDrafter, prompts: list[list[int]]) -> dict:
    engine = SpecEngine(verifier, drafter, policy=FixedK(2))
    sched = TargetScheduler("tiny", engine, max_running=8, max_waiting=8, metrics=ServeMetrics())
    queues = {f"s{i}": sched.submit(GenerationRequest(f"s{i}", p, N_TOKENS)) for i, p in enumerate(prompts)}
    results = {}
    for seq_id, queue in queues.items():
        tokens = []
        while True:
            ev = await asyncio.wait_for(queue.get(), 30)
            if ev.error is not None:
                results[seq_id] = ev.error
                break
            tokens += ev.tokens
            if ev.finished:
                results[seq_id] = tokens
                break
    sched.task.cancel()
    return results


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=0)


def test_one_failing_sequence_does_not_fail_its_batch(target):
    prompts = random_prompts(4, seed=11)
    verifier = FlakyVerifier(TargetVerifier(target), poison="s2")
    results = asyncio.run(serve_all(verifier, SortedDrafter(noisy_draft(target)), prompts))
    assert isinstance(results["s2"], ServiceUnavailableError)
    for i in (0, 1, 3):
        assert results[f"s{i}"] == reference_greedy(target, prompts[i], N_TOKENS)
    assert len(verifier.verifier.table) == 0  # the failed sequence's state was released too


def test_a_round_lost_with_a_replica_is_retried_exactly(target):
    prompts = random_prompts(3, seed=12)
    verifier = FlakyVerifier(TargetVerifier(target), transient=1)
    results = asyncio.run(serve_all(verifier, SortedDrafter(noisy_draft(target)), prompts))
    for i, p in enumerate(prompts):
        assert results[f"s{i}"] == reference_greedy(target, p, N_TOKENS)


def test_timeouts_are_not_retried(target):
    verifier = FlakyVerifier(TargetVerifier(target), transient=1, error=TargetTimeoutError)
    results = asyncio.run(serve_all(verifier, SortedDrafter(noisy_draft(target)), random_prompts(3, seed=13)))
    assert all(isinstance(r, TargetTimeoutError) for r in results.values())
    assert verifier.calls == 1
