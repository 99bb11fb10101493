"""A hung draft (alive, never answering) costs the router one short wait per backoff period, not call_timeout_s of
every round: the wait follows the draft's measured seconds per drafted position (serve/draft_deadline.py), and the
target-only spell after a failure doubles up to retry_max_s and resets after a success."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from s2d_ray.core.types import DraftRequest, Proposal
from s2d_ray.serve.clients import DraftClient
from s2d_ray.serve.draft_deadline import DeadlinePolicy, DraftDeadline, drafted_positions
from s2d_ray.serve.replica import Counted


def test_the_wait_follows_measured_speed_within_the_cap():
    d = DraftDeadline(DeadlinePolicy(cap_s=30.0, retry_after_s=1.0, margin=4.0, floor_s=0.5, min_samples=2))
    assert d.timeout(10) == 30.0  # nothing measured yet: the cap
    d.succeeded(0.02, 10)
    d.succeeded(0.01, 10)
    assert d.timeout(10) == 0.5 + 4 * 0.002 * 10  # the worst measured rate, times the margin, plus the floor
    assert d.timeout(100_000) == 30.0  # never above the cap
    assert [d.failed() for _ in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
    d.succeeded(0.01, 10)
    assert d.failed() == 1  # a success resets the backoff


def test_positions_count_what_the_draft_computes():
    rows = [DraftRequest("a", [1] * 20, 4), DraftRequest("b", [1] * 8, 2)]
    assert drafted_positions(rows, [19, 0]) == (1 + 4) + (8 + 2)
    assert drafted_positions(rows, [20, 8]) == (1 + 4) + (1 + 2)  # nothing new still drafts from its last token


class Draft:
    """A draft deployment that answers in 10 ms, or never once `hung`."""

    def __init__(self) -> None:
        self.hung, self.calls = False, 0
        self.propose = SimpleNamespace(remote=self._propose)

    async def _propose(self, target, drafts, seen, affinity=None):
        self.calls += 1
        if self.hung:
            await asyncio.Event().wait()
        await asyncio.sleep(0.01)
        return Counted([Proposal.empty() for _ in drafts], 0, "r0")


def test_a_hung_draft_costs_a_short_wait_per_backoff_period():
    async def run() -> tuple[float, int, int]:
        draft, fallbacks = Draft(), []
        client = DraftClient(draft, "t", timeout_s=30.0, retry_after_s=0.2, on_fallback=lambda: fallbacks.append(1),
                             deadline=DraftDeadline(DeadlinePolicy(30.0, 0.2, retry_max_s=0.8, floor_s=0.1)))
        rows = [DraftRequest("s", [1, 2, 3], 4)]
        for _ in range(6):  # measured: about 10 ms for 3 + 4 positions
            await client.propose(rows)
        draft.hung = True
        calls_before, started = draft.calls, time.monotonic()
        while time.monotonic() - started < 3.0:  # rounds keep coming, as a decode loop's do
            await client.propose(rows)
            await asyncio.sleep(0.01)
        return time.monotonic() - started, draft.calls - calls_before, len(fallbacks)

    took, hung_calls, fallbacks = asyncio.run(run())
    # Waits of ~0.1-0.3 s, then target-only for 0.2, 0.4, 0.8, 0.8 s: a handful of calls in 3 s, not one per round.
    assert 3 <= hung_calls <= 8, hung_calls
    assert fallbacks >= 50  # the rest of the rounds went target-only at once
    assert took < 4.0


def test_without_the_derived_wait_a_hung_draft_holds_a_round_for_the_cap():
    """The negative control: with the old fixed wait (min_samples never reached) one hung call takes the cap."""
    async def run() -> float:
        draft = Draft()
        client = DraftClient(draft, "t", timeout_s=1.0, retry_after_s=0.2, on_fallback=lambda: None,
                             deadline=DraftDeadline(DeadlinePolicy(1.0, 0.2, min_samples=10**9)))
        rows = [DraftRequest("s", [1, 2, 3], 4)]
        await client.propose(rows)
        draft.hung = True
        started = time.monotonic()
        await client.propose(rows)
        return time.monotonic() - started

    assert asyncio.run(run()) >= 0.95
