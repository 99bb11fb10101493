"""TargetScheduler without Ray: the router's real clients over in-process tiny float64 models behind async handles.

Admission and queueing, capacity, cancel and abort races with a round in flight, draft fallback, KV release on finish.
The handles below have a Ray handle's shape (`handle.method.remote(...)` returns an awaitable) and nothing else.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
from types import SimpleNamespace

import pytest

from core_fixtures import noisy_draft, random_prompts, tiny_target
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.policy import FixedK
from s2d_ray.core.target import TargetVerifier
from s2d_ray.errors import CapacityError, RequestError, ServiceUnavailableError
from s2d_ray.serve.metrics import ServeMetrics
from s2d_ray.serve.replica import Counted, InProcessHandle, ModelThread, recomputed_tokens, score_counted
from s2d_ray.serve.clients import DraftClient, TargetClient
from s2d_ray.serve.scheduler import TargetScheduler

NEW_TOKENS = 12


class LocalHandle(InProcessHandle):
    """`handle.<method>.remote(*args)` -> an awaitable of `obj.<method>(*args)`; `gate` (when set) holds score calls.
    An InProcessHandle: a scheduler given a model thread may run rounds whole, calling obj's `*_now` methods."""

    def __init__(self, obj) -> None:
        super().__init__(obj)
        self.obj = obj
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()

    def __getattr__(self, name: str):
        fn = getattr(self.obj, name)

        async def call(*args, **kwargs):
            if name == "score" and self.gate is not None:
                self.entered.set()
                await self.gate.wait()
            return fn(*args, **kwargs)

        return SimpleNamespace(remote=call)


class DraftReplica:
    """The draft deployment's call shape: propose(target, drafts, seen, affinity=) -> Counted; `fail` makes every
    propose raise."""

    def __init__(self, drafter: SortedDrafter) -> None:
        self.drafter, self.fail, self.calls = drafter, False, 0
        self.now_threads: set[int] = set()  # threads the `*_now` calls ran on

    def propose(self, target: str, drafts, seen, affinity=None):
        self.calls += 1
        if self.fail:
            raise RuntimeError("draft replica died")
        recomputed = sum(recomputed_tokens(self.drafter.table, drafts, seen))
        return Counted(self.drafter.propose(drafts), recomputed, "local")

    def release(self, seq_id: str, affinity=None) -> None:
        self.drafter.release(seq_id)

    def propose_now(self, target: str, drafts, seen):
        self.now_threads.add(threading.get_ident())
        return self.propose(target, drafts, seen)

    def release_now(self, seq_id: str) -> None:
        self.now_threads.add(threading.get_ident())
        self.release(seq_id)


class TargetReplica:
    """The target deployment's call shape; records the sequence ids of every batch it scores."""

    def __init__(self, verifier: TargetVerifier) -> None:
        self.verifier, self.batches, self.fail = verifier, [], False
        self.now_threads: set[int] = set()
        self.inline = True  # score_now can run (the model is in this process)
        self.seen: list[dict[str, int]] = []  # per call: seq_id -> positions the router says earlier calls computed

    def score(self, requests, seen, affinity=None):
        self.batches.append([r.seq_id for r in requests])
        self.seen.append({r.seq_id: n for r, n in zip(requests, seen)})
        if self.fail:
            raise RuntimeError("target replica died")
        logits, recomputed = score_counted(self.verifier, requests, seen)
        return Counted(logits, sum(recomputed), "local")

    def release(self, seq_id: str, affinity=None) -> None:
        self.verifier.release(seq_id)

    def score_now(self, requests, seen):
        self.now_threads.add(threading.get_ident())
        return self.score(requests, seen)

    def release_now(self, seq_id: str) -> None:
        self.now_threads.add(threading.get_ident())
        self.release(seq_id)


@pytest.fixture(scope="module")
def target():
    return tiny_target(seed=3)


@pytest.fixture(scope="module")
def expected(target):
    """Target-only greedy continuations of the prompts every test uses (the lossless reference)."""
    prompts = random_prompts(6, seed=5)
    out = SpecEngine(TargetVerifier(target)).generate(
        [GenerationRequest(f"r{i}", p, NEW_TOKENS) for i, p in enumerate(prompts)])
    return prompts, [r.token_ids for r in out]


class Setup:
    def __init__(self, target, max_running: int, max_waiting: int, speculate: bool = True,
                 max_context: int | None = None, retry_after_s: float = 60.0, plain_steps: int = 1,
                 thread: ModelThread | None = None, busy_elsewhere=None) -> None:
        self.target_replica = TargetReplica(TargetVerifier(target))
        self.draft_replica = DraftReplica(SortedDrafter(noisy_draft(target)))
        self.target_handle = LocalHandle(self.target_replica)
        self.fallbacks = 0
        draft = None
        if speculate:
            draft = DraftClient(LocalHandle(self.draft_replica), "t", timeout_s=5.0, retry_after_s=retry_after_s,
                                on_fallback=self._fallback)
        verifier = TargetClient(self.target_handle, "t", timeout_s=5.0)
        engine = SpecEngine(verifier, draft, policy=FixedK(3), max_context=max_context, plain_steps=plain_steps)
        self.sched = TargetScheduler("t", engine, max_running, max_waiting, ServeMetrics(), thread, busy_elsewhere)

    def _fallback(self) -> None:
        self.fallbacks += 1

    def submit(self, seq_id: str, prompt: list[int], n: int = NEW_TOKENS) -> asyncio.Queue:
        return self.sched.submit(GenerationRequest(seq_id, prompt, n))

    async def settle(self) -> None:
        """Let the loop reach its idle wait and the fire-and-forget releases run."""
        for _ in range(50):
            await asyncio.sleep(0)

    @property
    def num_active(self) -> tuple[int, int]:
        return self.target_replica.verifier.num_active, self.draft_replica.drafter.num_active

    def run(self, main):
        """asyncio.run(main()), then stop the scheduler's loop task."""

        async def wrapped():
            try:
                return await main()
            finally:
                if self.sched.task is not None:
                    self.sched.task.cancel()

        return asyncio.run(wrapped())


async def collect(queue: asyncio.Queue) -> tuple[list[int], object]:
    tokens = []
    while True:
        ev = await asyncio.wait_for(queue.get(), 10.0)
        if ev.error is not None:
            return tokens, ev
        tokens += ev.tokens
        if ev.finished:
            return tokens, ev


def test_the_scheduler_runs_without_ray():
    import subprocess

    modules = ["scheduler", "clients", "affinity", "events", "round_timing", "metrics"]
    code = f"import sys, {', '.join(f's2d_ray.serve.{m}' for m in modules)}; sys.exit('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_admission_queues_beyond_max_running_and_every_output_is_the_targets(target, expected):
    prompts, want = expected
    s = Setup(target, max_running=2, max_waiting=8)

    async def main():
        queues = [s.submit(f"r{i}", p) for i, p in enumerate(prompts)]
        assert s.sched.num_running == 0 and len(s.sched.waiting) == len(prompts)  # admitted between rounds only
        results = await asyncio.gather(*(collect(q) for q in queues))
        await s.settle()
        return results

    results = s.run(main)
    for (tokens, last), ref in zip(results, want):
        assert tokens == ref
        assert last.finished and last.finish_reason == "length"
        assert last.metrics["num_generated_tokens"] == NEW_TOKENS
    assert max(len(b) for b in s.target_replica.batches) == 2  # never more than max_running in a round
    assert sum(r[1].metrics["num_accepted_draft_tokens"] for r in results) > 0  # it did speculate
    assert s.num_active == (0, 0)  # every finished sequence released its KV on both replicas
    assert s.sched.num_running == 0 and not s.sched.waiting and not s.sched.queues


def test_capacity_counts_running_and_waiting_and_frees_on_finish(target, expected):
    prompts, want = expected
    s = Setup(target, max_running=1, max_waiting=1)

    async def main():
        first, second = s.submit("a", prompts[0]), s.submit("b", prompts[1])
        with pytest.raises(CapacityError, match="at capacity"):
            s.submit("c", prompts[2])
        a, b = await collect(first), await collect(second)
        third = await collect(s.submit("c", prompts[2]))  # room again
        return a, b, third

    a, b, c = s.run(main)
    assert [a[0], b[0], c[0]] == want[:3]


def test_reservations_count_against_capacity_before_any_preparation(target, expected):
    """A request reserves its place before it is tokenized (`reserve`): with the target full of running, queued
    and in-preparation requests the next one is refused at once; a reservation given up (an error while preparing)
    or turned into a submit frees or keeps the place as it should."""
    prompts, want = expected
    s = Setup(target, max_running=1, max_waiting=2)

    async def main():
        first = s.submit("a", prompts[0])
        with s.sched.reserve():
            with s.sched.reserve():
                with pytest.raises(CapacityError, match="at capacity"):
                    with s.sched.reserve():
                        pass
            second = s.submit("b", prompts[1])  # the outer reservation's request: room kept for it
        assert s.sched.preparing == 0
        with s.sched.reserve():  # two of three places taken: one left
            with pytest.raises(CapacityError):
                with s.sched.reserve():
                    raise AssertionError("a place was given past capacity")
        with pytest.raises(RuntimeError):
            with s.sched.reserve():
                raise RuntimeError("tokenizer failed")  # the place is freed on error
        assert s.sched.preparing == 0
        return await collect(first), await collect(second)

    a, b = s.run(main)
    assert [a[0], b[0]] == want[:2]


def test_an_invalid_request_gets_an_error_event_and_the_others_run(target, expected):
    prompts, want = expected
    s = Setup(target, max_running=4, max_waiting=4, max_context=40)

    async def main():
        bad = s.submit("bad", list(range(3, 60)))  # longer than the context limit: refused at admission
        good = s.submit("good", prompts[0])
        return await collect(bad), await collect(good)

    (bad_tokens, bad_ev), (good_tokens, _) = s.run(main)
    assert bad_tokens == [] and isinstance(bad_ev.error, RequestError) and "context limit" in str(bad_ev.error)
    assert good_tokens == want[0]


def test_cancel_while_waiting_never_reaches_the_replicas(target, expected):
    prompts, want = expected
    s = Setup(target, max_running=1, max_waiting=4)

    async def main():
        first = s.submit("first", prompts[0])
        s.submit("gone", prompts[1])
        s.sched.cancel("gone")
        result = await collect(first)
        await s.settle()
        return result

    tokens, _ = s.run(main)
    assert tokens == want[0]
    assert all("gone" not in b for b in s.target_replica.batches)
    assert s.draft_replica.drafter.num_active == 0 and s.num_active == (0, 0)


def test_cancel_during_a_round_in_flight_aborts_before_the_next_and_frees_kv(target, expected):
    """The race: the client goes away while a round that uses its sequence is in flight."""
    prompts, want = expected
    s = Setup(target, max_running=4, max_waiting=4)

    async def main():
        s.target_handle.gate = asyncio.Event()
        stay, leave = s.submit("stay", prompts[0]), s.submit("leave", prompts[1])
        await s.target_handle.entered.wait()  # round 1 is inside the target call, both sequences in it
        s.sched.cancel("leave")
        assert "leave" in s.sched.engine.seqs  # not aborted under the running round...
        s.target_handle.gate.set()
        s.target_handle.gate = None
        result = await collect(stay)
        await s.settle()
        return result, leave

    (tokens, _), leave = s.run(main)
    assert tokens == want[0]
    assert leave.empty()  # ...and nothing was delivered to the cancelled request
    rounds_with_leave = [b for b in s.target_replica.batches if "leave" in b]
    assert len(rounds_with_leave) == 1  # only the round that was already in flight
    assert s.num_active == (0, 0)


def test_a_listener_that_vanished_mid_stream_is_aborted_without_cancel(target, expected):
    """An output for a sequence whose queue is gone (the consumer dropped it) aborts it before the next round."""
    prompts, want = expected
    s = Setup(target, max_running=4, max_waiting=4)

    async def main():
        s.submit("orphan", prompts[1], n=40)
        stay = s.submit("stay", prompts[0])
        await asyncio.wait_for(s.sched.queues["orphan"].get(), 10.0)  # one round done
        del s.sched.queues["orphan"]  # the listener is gone without calling cancel
        result = await collect(stay)
        await s.settle()
        return result

    tokens, _ = s.run(main)
    assert tokens == want[0]
    assert "orphan" not in s.sched.engine.seqs
    assert len([b for b in s.target_replica.batches if "orphan" in b]) <= 3
    assert s.num_active == (0, 0)


def test_draft_failure_falls_back_to_target_only_rounds_and_speculation_resumes(target, expected):
    prompts, want = expected
    s = Setup(target, max_running=4, max_waiting=4, retry_after_s=0.0)
    s.draft_replica.fail = True

    async def main():
        first = await collect(s.submit("a", prompts[0]))
        s.draft_replica.fail = False
        second = await collect(s.submit("b", prompts[1]))
        await s.settle()
        return first, second

    (a, a_last), (b, b_last) = s.run(main)
    assert a == want[0] and b == want[1]  # lossless either way
    assert s.fallbacks > 0 and a_last.metrics["num_draft_tokens"] == 0
    assert b_last.metrics["num_draft_tokens"] > 0  # retry_after_s passed: the draft is used again
    assert s.num_active == (0, 0)


def test_a_target_failure_ends_every_live_request_with_503_and_frees_them(target, expected):
    prompts, _ = expected
    s = Setup(target, max_running=4, max_waiting=4)
    s.target_replica.fail = True

    async def main():
        queues = [s.submit(f"r{i}", p) for i, p in enumerate(prompts[:3])]
        results = await asyncio.gather(*(collect(q) for q in queues))
        await s.settle()
        return results

    results = s.run(main)
    for tokens, ev in results:
        assert tokens == [] and isinstance(ev.error, ServiceUnavailableError)
    assert s.sched.num_running == 0 and not s.sched.queues


def test_ar_mode_scheduler_has_no_drafter(target, expected):
    prompts, want = expected
    s = Setup(target, max_running=2, max_waiting=4, speculate=False)

    async def main():
        return await asyncio.gather(*(collect(s.submit(f"r{i}", p)) for i, p in enumerate(prompts[:3])))

    results = s.run(main)
    assert [r[0] for r in results] == want[:3]
    assert s.draft_replica.calls == 0


def test_plain_rounds_take_several_steps_per_target_call(target, expected):
    """`plain_steps`: a round with no speculating row asks the target deployment for up to 4 greedy tokens per call;
    the tokens are the target's, the calls a third of the tokens, and the router's record of what the replica
    computed covers the steps (nothing counted as recomputed on the next call)."""
    prompts, want = expected
    s = Setup(target, max_running=3, max_waiting=4, speculate=False, plain_steps=4)

    async def main():
        return await asyncio.gather(*(collect(s.submit(f"r{i}", p)) for i, p in enumerate(prompts[:3])))

    results = s.run(main)
    assert [r[0] for r in results] == want[:3]
    # the prompt's call is one pass, then 4 steps a call (one step per call: NEW_TOKENS calls)
    assert len(s.target_replica.batches) == 1 + -(-(NEW_TOKENS - 1) // 4)
    assert s.target_replica.seen[1] == {f"r{i}": len(p) for i, p in enumerate(prompts[:3])}
    third = s.target_replica.seen[2]
    assert third == {f"r{i}": len(p) + 4 for i, p in enumerate(prompts[:3])}  # + 1 + 4 steps, the last no KV yet
    assert sum(s.sched.engine.verifier.affinity.recomputed.values()) == 0


def test_the_model_thread_counts_its_cpu_time_apart_from_waiting():
    """ModelThread.cpu_s: CPU seconds of its calls (time.thread_time), so a replica can tell a forward that waited
    (for a core or the GIL) from a slow one; CallTimes reports it per call."""
    import time

    from s2d_ray.serve.replica import ModelThread
    from s2d_ray.serve.round_timing import CallTimes

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    thread = ModelThread(None)

    async def main():
        await thread.run(time.sleep, 0.2)  # waiting, not computing
        slept = thread.cpu_s
        await thread.run(spin, 0.1)
        return slept, thread.cpu_s - slept

    slept, spun = asyncio.run(main())
    thread.close()
    assert slept < 0.05 and 0.1 <= spun < 0.5
    times = CallTimes()
    times.add(0.030, 0.020, 0.015)
    assert times.summary()["mean_replica_cpu_ms"] == pytest.approx(15.0)


def test_timing_reports_the_budgets_measured_rounds(target):
    """A load-aware engine's scheduler shows the measured seconds per token by kind of round and batch size (what the
    draft/plain choice runs on) in its timing stats; an engine without costs shows none."""
    from s2d_ray.core.budget import SpeculationBudget, TreeShape
    from s2d_ray.core.costs import CostModel
    from s2d_ray.core.lookup import PromptLookup, TreeDrafter

    costs = CostModel({1: {1: 10.0, 2: 10.2, 4: 10.4, 8: 11.0}}, [0.5, 0.6, 0.7])
    budget = SpeculationBudget(TreeShape(width=2, lookup=True, max_nodes=8), costs, max_depth=3)
    drafter = TreeDrafter(SortedDrafter(noisy_draft(target)), PromptLookup(max_ngram=3, num_tokens=4))
    engine = SpecEngine(TargetVerifier(target), drafter, FixedK(3), budget=budget)
    engine.generate([GenerationRequest("a", random_prompts(1, seed=4)[0], 24)])
    stats = TargetScheduler("t", engine, 4, 4, ServeMetrics()).timing()["speculation"]
    assert stats["rounds"] > 1 and stats["measured"]
    assert all(k.split("/")[0] == "1" and k.split("/")[1] in ("draft", "tree", "plain", "nodraft")
               and v["ms_per_token"] > 0 for k, v in stats["measured"].items())
    plain = SpecEngine(TargetVerifier(target))
    assert "speculation" not in TargetScheduler("t", plain, 4, 4, ServeMetrics()).timing()


def test_models_of_one_process_share_its_model_thread_and_count_their_own_cpu():
    """A draft and a target placed in one (router) process run their forwards on ONE OS thread (two threads would
    each start a libgomp worker pool, which throttles the workers' spin and slows every prefill); each still
    reports only its own forwards' CPU time."""
    import threading
    import time

    from core_fixtures import tiny_target
    from s2d_ray.core.target import TargetVerifier
    from s2d_ray.core.types import ScoreRequest
    from s2d_ray.serve.replica import process_model_thread
    from s2d_ray.serve.target_deployment import LocalTarget

    target = LocalTarget(TargetVerifier(tiny_target(seed=1)), 1)
    draft_thread = process_model_thread(1)  # what DraftDeployment takes for its forwards
    assert target.thread is draft_thread and process_model_thread(2) is not draft_thread

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    async def main():
        idents = {await target.thread.run(threading.get_ident), await draft_thread.run(threading.get_ident)}
        logits, recomputed = await target.score([ScoreRequest("s", [1, 2, 3, 4], 1)], [0])
        own = target.cpu_s
        await draft_thread.run(spin, 0.2)  # the draft's work on the same thread
        return idents, logits, recomputed, own, target.cpu_s

    idents, logits, recomputed, own, after = asyncio.run(main())
    assert len(idents) == 1 and threading.get_ident() not in idents
    assert logits[0].shape[0] == 1 and recomputed == [0]
    assert 0 < own < 0.2 and after == own  # the draft's 0.2 s is not the target's


def test_a_stream_interval_merges_events_but_never_holds_the_first_tokens_or_the_end():
    """`router.stream_interval`: events are merged until they hold that many tokens; the first tokens go at once
    (TTFT), the last event flushes whatever was held; tokens, logprobs and the end survive merging in order, and
    closing the merged stream closes the request's own (which is what aborts its sequence)."""
    from s2d_ray.serve.events import Event, coalesced

    closed = []

    async def events(parts):
        try:
            for p in parts:
                yield p
        finally:
            closed.append(True)

    def ev(tokens, **kw):
        return Event(list(tokens), logprobs=[f"lp{t}" for t in tokens], **kw)

    async def collect(parts, n):
        return [e async for e in coalesced(events(parts), n)]

    parts = [ev([1, 2]), ev([3]), ev([4, 5]), ev([6]), ev([7, 8, 9, 10]), ev([11]), ev([], finished=True,
                                                                                        finish_reason="length",
                                                                                        metrics={"m": 1})]
    out = asyncio.run(collect(parts, 3))
    assert [e.tokens for e in out] == [[1, 2], [3, 4, 5], [6, 7, 8, 9, 10], [11]]
    assert [e.logprobs for e in out][1] == ["lp3", "lp4", "lp5"]
    assert (out[-1].finished, out[-1].finish_reason, out[-1].metrics) == (True, "length", {"m": 1})
    assert not any(e.finished for e in out[:-1]) and closed == [True]
    # Interval 1 changes nothing; an event with only prompt logprobs (echo) is the first chunk and goes at once.
    assert [e.tokens for e in asyncio.run(collect(parts, 1))] == [p.tokens for p in parts]
    first = Event([], prompt_logprobs=["p0"])
    out = asyncio.run(collect([first, ev([1]), ev([2], finished=True, finish_reason="stop")], 4))
    assert [(e.tokens, e.prompt_logprobs) for e in out] == [([], ["p0"]), ([1, 2], None)]

    async def close_early():
        stream = coalesced(events([ev([1]), ev([2]), ev([3])]), 2)
        assert (await stream.__anext__()).tokens == [1]
        await stream.aclose()

    closed.clear()
    asyncio.run(close_early())
    assert closed == [True]


def test_rounds_run_whole_on_the_model_thread_while_no_other_target_has_work(target, expected):
    """With the draft and the target in the router's process, a round runs whole on the model thread (the clients'
    calls are plain calls there, releases too) while `busy_elsewhere` says no other target's round could merge with
    it; otherwise through the queued calls. Either way, or alternating round by round (the state is one), every
    output is the target's greedy continuation and every sequence's KV is freed."""
    prompts, want = expected
    thread = ModelThread(1)
    model_ident = asyncio.run(thread.run(threading.get_ident))
    for busy, whole in ((lambda: False, "all"), (lambda: True, "none"),
                        (itertools.cycle([False, True]).__next__, "some")):
        s = Setup(target, max_running=2, max_waiting=4, thread=thread, busy_elsewhere=busy)

        async def main():
            results = await asyncio.gather(*(collect(s.submit(f"r{i}", p)) for i, p in enumerate(prompts[:3])))
            await s.settle()
            return results

        results = s.run(main)
        assert [r[0] for r in results] == want[:3], whole
        assert sum(ev.metrics["num_draft_tokens"] for _, ev in results) > 0  # the draft proposed
        rounds, now = s.sched.rounds.rounds, s.sched.rounds_now
        assert {"all": now == rounds, "none": now == 0, "some": 0 < now < rounds}[whole], (whole, now, rounds)
        threads = s.draft_replica.now_threads | s.target_replica.now_threads
        assert threads == (set() if whole == "none" else {model_ident})
        assert s.sched.timing()["round"]["whole"] == now
        assert s.num_active == (0, 0)  # released on the model thread or through the handles
    thread.close()


def test_a_whole_round_falls_back_without_the_draft_and_fails_like_a_queued_one(target, expected):
    """A draft that raises in a whole round means target-only rounds (the same fallback as a failed call); a target
    that raises fails the round, the one-by-one retry runs through the queued calls and fails each request with 503."""
    prompts, want = expected
    thread = ModelThread(1)
    s = Setup(target, max_running=4, max_waiting=4, thread=thread)
    s.draft_replica.fail = True

    async def main():
        return await collect(s.submit("a", prompts[0]))

    tokens, last = s.run(main)
    assert tokens == want[0] and s.fallbacks > 0 and last.metrics["num_draft_tokens"] == 0
    assert s.sched.rounds_now > 0

    s = Setup(target, max_running=4, max_waiting=4, thread=thread)
    s.target_replica.fail = True

    async def failing():
        results = await asyncio.gather(*(collect(s.submit(f"r{i}", p)) for i, p in enumerate(prompts[:2])))
        await s.settle()
        return results

    for tokens, ev in s.run(failing):
        assert tokens == [] and isinstance(ev.error, ServiceUnavailableError)
    assert s.sched.num_running == 0 and len(s.target_replica.batches) == 3  # the whole round, then one by one
    thread.close()
