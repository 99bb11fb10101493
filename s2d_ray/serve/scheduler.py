"""The router's decode loop for one target: ONE SpecEngine whose drafter and verifier are Ray deployment handles.

Continuous batching: requests queue, join the engine between rounds (up to max_concurrent_sequences), and every
round is one batched propose + one batched verification for all live sequences of the target. All engine mutations
(admit, abort) happen in the loop between rounds, so an abort never races a round that is using the sequence's KV.
If the draft deployment fails, the round runs target-only (empty proposals: still exactly the target's tokens) and
speculation resumes after `retry_after_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import torch

from ..core.engine import GenerationRequest, SpecEngine
from ..core.stack import common_prefix
from ..core.types import DraftRequest, Proposal, ScoreRequest
from ..errors import CapacityError, RequestError, S2DError, ServiceUnavailableError
from .affinity_keys import sequence_key, split_call
from .metrics import ServeMetrics
from .replica import InProcessHandle, ModelThread

logger = logging.getLogger(__name__)


class TargetTimeoutError(ServiceUnavailableError):
    """The target did not answer in time; its rounds are not retried (each retry would wait as long again)."""


RELEASE_TIMEOUT_S = 30.0


class Releases:
    """KV releases nobody waits for: sent at once, bounded, failures logged (a dead replica has no state left)."""

    def __init__(self) -> None:
        self._pending: set[asyncio.Task] = set()  # strong references until done (asyncio keeps only weak ones)

    def send(self, awaitable: Awaitable, what: str) -> None:
        async def run() -> None:
            try:
                await _bounded(awaitable, RELEASE_TIMEOUT_S)
            except Exception as exc:
                logger.debug("%s failed: %s", what, exc)

        task = asyncio.ensure_future(run())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)


async def _bounded(awaitable: Awaitable, timeout_s: float) -> Any:
    async def wait() -> Any:
        return await awaitable

    return await asyncio.wait_for(wait(), timeout_s)


class Affinity:
    """A router client's side of affinity for one deployment: the router's routing key (each sequence's key is it
    plus the sequence id, `key_for`), and per live sequence the tokens whose KV the deployment computed in the last
    successful round. `expected` is how many of a new call's leading tokens that covers (what the replica holds if
    nothing moved); `record` counts what a replica reported recomputing into
    `s2d_recomputed_tokens_total{deployment, replica}` (each call counted once, by its caller)."""

    def __init__(self, key: str | None, deployment: str, counter: Any = None) -> None:
        self.key, self.deployment, self.counter = key, deployment, counter
        self.recomputed: dict[str, int] = {}  # replica -> tokens it recomputed for this client's calls
        self._tokens: dict[str, list[int]] = {}

    def key_for(self, seq_id: str) -> str | None:
        return sequence_key(self.key, seq_id)

    def gathered(self, parts: list[tuple[list[int], Any]], n: int) -> list:
        """The results of a round split over replicas (`affinity.split_call`), in request order; each call's
        recomputed tokens recorded against the replica that answered it."""
        out: list = [None] * n
        for idx, reply in parts:
            self.record(reply.recomputed, reply.replica)
            for i, result in zip(idx, reply.results):
                out[i] = result
        return out

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


@dataclass
class CallTimes:
    """Where a deployment's calls spend their time, seen from the router: the calls' wall seconds and what the
    replica reported spending on them (`Counted.seconds`: its forwards and model-thread hop). The difference is the
    price of the call itself (Ray transport, @serve.batch, the replica's event loop), paid once per round."""

    calls: int = 0
    wall_s: float = 0.0
    replica_s: float = 0.0
    replica_cpu_s: float = 0.0  # the model thread's CPU time in those calls (Counted.cpu_seconds; 0: not measured)
    observe: Callable[[float], None] | None = None  # e.g. a Prometheus histogram's observe, per call overhead

    def add(self, wall_s: float, replica_s: float, replica_cpu_s: float = 0.0) -> None:
        self.calls += 1
        self.wall_s += wall_s
        self.replica_s += replica_s
        self.replica_cpu_s += replica_cpu_s
        if self.observe is not None and replica_s > 0:
            self.observe(max(wall_s - replica_s, 0.0))

    def add_slowest(self, wall_s: float, replies: Iterator[Any]) -> None:
        """One round's call(s): the wall time, and the replica time of the slowest reply (a round split over replicas
        waits for it), or 0 when no replica answered."""
        slowest = max(replies, key=lambda reply: reply.seconds, default=None)
        self.add(wall_s, slowest.seconds if slowest else 0.0, slowest.cpu_seconds if slowest else 0.0)

    def summary(self) -> dict:
        n = max(self.calls, 1)
        return {"calls": self.calls, "mean_call_ms": 1e3 * self.wall_s / n,
                "mean_replica_ms": 1e3 * self.replica_s / n, "mean_replica_cpu_ms": 1e3 * self.replica_cpu_s / n,
                "mean_overhead_ms": 1e3 * (self.wall_s - self.replica_s) / n}


class DraftClient:
    """The engine's drafter: the shared draft deployment, degrading to target-only rounds while it is down.

    A round is one call per draft replica its sequences' affinity keys prefer (the replica holding each sequence)
    and carries, per request, how many tokens an earlier round drafted over (the replica reports what it had to
    recompute)."""

    def __init__(self, handle, target: str, timeout_s: float, retry_after_s: float,
                 on_fallback: Callable[[], None], affinity: Affinity | None = None) -> None:
        self.handle, self.target = handle, target
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self.on_fallback = on_fallback
        self.affinity = affinity or Affinity(None, "draft")
        self.down_until = 0.0
        self.releases = Releases()
        self.times = CallTimes()
        # The draft in this process (draft.placement: router), and whether the caller is on its model thread now
        # (a round run there whole, `TargetScheduler`): then a call is a plain call, not a queued coroutine.
        self.local = handle.local if isinstance(handle, InProcessHandle) else None
        self.now = False

    def propose(self, drafts: list[DraftRequest]) -> list[Proposal] | Awaitable[list[Proposal]]:
        return self._propose_now(drafts) if self.now else self._propose(drafts)

    async def _propose(self, drafts: list[DraftRequest]) -> list[Proposal]:
        if time.monotonic() >= self.down_until:
            aff = self.affinity
            seen = [aff.expected(d.seq_id, d.tokens) for d in drafts]
            start = time.perf_counter()

            def call(idx: list[int], key: str | None):
                return self.handle.propose.remote(self.target, [drafts[i] for i in idx], [seen[i] for i in idx],
                                                  affinity=key)

            try:
                keys = [aff.key_for(d.seq_id) for d in drafts]
                parts = await _bounded(split_call(self.handle, keys, call), self.timeout_s)
            except Exception as exc:
                self._down(exc)
            else:
                return self._answered(drafts, parts, start)
        self.on_fallback()
        return [Proposal.empty() for _ in drafts]

    def _propose_now(self, drafts: list[DraftRequest]) -> list[Proposal]:
        if time.monotonic() >= self.down_until:
            seen = [self.affinity.expected(d.seq_id, d.tokens) for d in drafts]
            start = time.perf_counter()
            try:
                reply = self.local.propose_now(self.target, drafts, seen)
            except Exception as exc:
                self._down(exc)
            else:
                return self._answered(drafts, [(list(range(len(drafts))), reply)], start)
        self.on_fallback()
        return [Proposal.empty() for _ in drafts]

    def _down(self, exc: Exception) -> None:
        logger.warning("draft failed (%s: %s); target-only for %.0f s", type(exc).__name__, exc, self.retry_after_s)
        self.down_until = time.monotonic() + self.retry_after_s

    def _answered(self, drafts: list[DraftRequest], parts: list[tuple[list[int], Any]],
                  start: float) -> list[Proposal]:
        aff = self.affinity
        self.times.add_slowest(time.perf_counter() - start, (reply for _, reply in parts))
        results = aff.gathered(parts, len(drafts))
        for d, p in zip(drafts, results):
            # A chain: the drafter ran every proposed token but the last through its first layers; a tree
            # (siblings are not a sequence): count only the prefix, which it surely holds.
            if p.tokens:
                aff.computed(d.seq_id, d.tokens + p.tokens[:-1] if p.parents is None else d.tokens)
        return results

    def release(self, seq_id: str) -> None:
        self.affinity.forget(seq_id)
        if self.now:
            _release_now(self.local, seq_id, "draft release")
            return
        self.releases.send(self.handle.release.remote(seq_id, affinity=self.affinity.key_for(seq_id)),
                           "draft release")


class TargetClient:
    """The engine's verifier: the target deployment; failures and timeouts become ServiceUnavailableError.
    Rounds are split over replicas by the sequences' affinity keys and carry what earlier rounds verified, like
    DraftClient's."""

    def __init__(self, handle, name: str, timeout_s: float, affinity: Affinity | None = None) -> None:
        self.handle, self.name, self.timeout_s = handle, name, timeout_s
        self.affinity = affinity or Affinity(None, f"target-{name}")
        self.releases = Releases()
        self.times = CallTimes()
        # The target's model in this process (placement: router, tp_size 1), and whether the caller is on its model
        # thread now (see DraftClient).
        local = handle.local if isinstance(handle, InProcessHandle) else None
        self.local = local if getattr(local, "inline", False) else None
        self.now = False

    def score(self, requests: list[ScoreRequest]) -> list[torch.Tensor] | Awaitable[list[torch.Tensor]]:
        return self._score_now(requests) if self.now else self._score(requests)

    async def _score(self, requests: list[ScoreRequest]) -> list[torch.Tensor]:
        aff = self.affinity
        seen = [aff.expected(r.seq_id, r.tokens) for r in requests]
        start = time.perf_counter()

        def call(idx: list[int], key: str | None):
            return self.handle.score.remote([requests[i] for i in idx], [seen[i] for i in idx], affinity=key)

        try:
            keys = [aff.key_for(r.seq_id) for r in requests]
            parts = await _bounded(split_call(self.handle, keys, call), self.timeout_s)
        except asyncio.TimeoutError:
            raise TargetTimeoutError(f"target {self.name} did not answer within {self.timeout_s:.0f} s") from None
        except Exception as exc:
            raise ServiceUnavailableError(f"target {self.name} failed: {type(exc).__name__}") from exc
        return self._answered(requests, parts, start)

    def _score_now(self, requests: list[ScoreRequest]) -> list[torch.Tensor]:
        seen = [self.affinity.expected(r.seq_id, r.tokens) for r in requests]
        start = time.perf_counter()
        try:
            reply = self.local.score_now(requests, seen)
        except Exception as exc:
            raise ServiceUnavailableError(f"target {self.name} failed: {type(exc).__name__}") from exc
        return self._answered(requests, [(list(range(len(requests))), reply)], start)

    def _answered(self, requests: list[ScoreRequest], parts: list[tuple[list[int], Any]],
                  start: float) -> list[torch.Tensor]:
        aff = self.affinity
        self.times.add_slowest(time.perf_counter() - start, (reply for _, reply in parts))
        results = aff.gathered(parts, len(requests))
        for r, res in zip(requests, results):
            if r.steps > 1:  # plain steps: the replica also computed every chosen token but the last
                aff.computed(r.seq_id, r.tokens + res.tolist()[:-1])
            else:  # a tree's nodes are not a sequence: count its prefix only (compacted on the next call)
                aff.computed(r.seq_id, r.tokens if r.parents is None else r.tokens[: len(r.tokens) - len(r.parents)])
        return results

    def release(self, seq_id: str) -> None:
        self.affinity.forget(seq_id)
        if self.now:
            _release_now(self.local, seq_id, "target release")
            return
        self.releases.send(self.handle.release.remote(seq_id, affinity=self.affinity.key_for(seq_id)),
                           "target release")


def _release_now(local: Any, seq_id: str, what: str) -> None:
    """A release on the model thread, during a round run there whole (failures logged, like `Releases`)."""
    try:
        local.release_now(seq_id)
    except Exception as exc:
        logger.debug("%s failed: %s", what, exc)


@dataclass
class RoundTimes:
    """The round loop's own clock: rounds, their wall seconds, and the gaps between back-to-back rounds (the router's
    bookkeeping between a round's end and the next one's start: events, admission, its event loop)."""

    rounds: int = 0
    round_s: float = 0.0
    gap_s: float = 0.0
    _last_end: float | None = None

    @contextlib.contextmanager
    def round(self) -> Iterator[None]:
        start = time.perf_counter()
        if self._last_end is not None:
            self.gap_s += start - self._last_end
        try:
            yield
        finally:
            self._last_end = time.perf_counter()
            self.rounds += 1
            self.round_s += self._last_end - start

    def idle(self) -> None:
        """No work: the wait for the next request is not a gap between rounds."""
        self._last_end = None

    def summary(self) -> dict:
        n = max(self.rounds, 1)
        return {"rounds": self.rounds, "mean_round_ms": 1e3 * self.round_s / n, "mean_gap_ms": 1e3 * self.gap_s / n}


@dataclass
class Event:
    """What one round did for one request (or the error that ended it)."""

    tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None
    metrics: dict | None = None
    error: Exception | None = None
    logprobs: list | None = None  # core.logprobs.TokenLogprob per token, when the request asked
    prompt_logprobs: list | None = None  # first round only, when the request asked

    def then(self, later: "Event") -> "Event":
        """This event and the next one as one (tokens and logprobs joined; the end, metrics and error are the later's)."""
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            [*(self.logprobs or []), *(later.logprobs or [])]
        prompt = self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs
        return Event([*self.tokens, *later.tokens], later.finished, later.finish_reason, later.metrics, later.error,
                     logprobs, prompt)


async def coalesced(events: AsyncIterator[Event], min_tokens: int) -> AsyncIterator[Event]:
    """A request's events merged until they hold `min_tokens` tokens (vLLM's and SGLang's stream interval): fewer
    chunks for the router, the proxy and the client to carry, at a coarser inter-token latency. The first tokens
    (TTFT) and the last event are never held (an error is raised by the request's own events, ending the stream at
    once). Closing this closes `events` (which aborts the sequence)."""
    held, started = None, False
    async with contextlib.aclosing(events) as source:
        async for ev in source:
            ev, held = (held.then(ev) if held is not None else ev), None
            if ev.finished or len(ev.tokens) >= min_tokens or (
                    not started and (ev.tokens or ev.prompt_logprobs is not None)):
                started = True
                yield ev
            else:
                held = ev


class TargetScheduler:
    """Admission, the round loop and per-request event queues for one target."""

    def __init__(self, name: str, engine: SpecEngine, max_running: int, max_waiting: int,
                 metrics: ServeMetrics, thread: ModelThread | None = None,
                 busy_elsewhere: Callable[[], bool] | None = None) -> None:
        self.name, self.engine = name, engine  # the engine owns its drafter and verifier clients
        self.max_running, self.max_waiting, self.metrics = max_running, max_waiting, metrics
        self.waiting: dict[str, GenerationRequest] = {}
        self.queues: dict[str, asyncio.Queue[Event]] = {}
        self.cancelled: set[str] = set()
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.rounds = RoundTimes()
        self.thread, self.busy_elsewhere = thread, busy_elsewhere or (lambda: False)
        self.clients = self._local_clients() if thread is not None else None
        self.rounds_now = 0  # rounds run whole on the model thread

    def _local_clients(self) -> list[DraftClient | TargetClient] | None:
        """The engine's clients when its target and draft are all in this process (else None): a round can then run
        whole on the model thread."""
        verifier, drafter = self.engine.verifier, self._draft_client()
        if not isinstance(verifier, TargetClient) or verifier.local is None:
            return None
        if isinstance(drafter, DraftClient):
            return [verifier, drafter] if drafter.local is not None else None
        return [verifier]  # no draft, or one that is plain code in this process (lookup)

    def _draft_client(self) -> Any:
        """The engine's drafter, unwrapped: a TreeDrafter wraps the draft client with free lookup."""
        return getattr(self.engine.drafter, "draft", self.engine.drafter)

    def timing(self) -> dict:
        """Round and per-call times (ms) for stats: where a served round spends what an in-process round does not."""
        out = {"round": {**self.rounds.summary(), "whole": self.rounds_now}}
        for role, client in (("target", self.engine.verifier), ("draft", self._draft_client())):
            times = getattr(client, "times", None)
            if isinstance(times, CallTimes):
                out[role] = times.summary()
        budget = self.engine.budget
        if budget is not None and budget.load_aware:  # what the draft/plain choice is measured on
            out["speculation"] = {"scale": budget.scale, "rounds": budget.rounds, "measured": budget.measured(),
                                  "fill_ms_per_token": 1000.0 * budget.fill_seconds(),
                                  "spent": budget.spent_by_kind()}
        return out

    @property
    def num_running(self) -> int:
        return len(self.engine.seqs)

    def submit(self, req: GenerationRequest) -> asyncio.Queue[Event]:
        if len(self.waiting) + self.num_running >= self.max_running + self.max_waiting:
            raise CapacityError(f"target {self.name} is at capacity ({self.max_running} running, "
                                f"{self.max_waiting} queued); retry later")
        queue: asyncio.Queue[Event] = asyncio.Queue()
        self.queues[req.seq_id] = queue
        self.waiting[req.seq_id] = req
        if self.task is None or self.task.done():
            # A fresh context: a task copies its creator's contextvars, which here include Serve's request context
            # of the HTTP request that happened to start the loop. Calls made under it are that request's children,
            # and Serve cancelled them when it ended (seen in a soak: a cancelled KV release leaked a target row).
            self.task = asyncio.get_running_loop().create_task(self._loop(), context=contextvars.Context())
        self.wake.set()
        return queue

    def cancel(self, seq_id: str) -> None:
        """Client gone or timed out: drop it from the queue, or abort it (freeing KV) before the next round."""
        self.queues.pop(seq_id, None)
        if self.waiting.pop(seq_id, None) is None and seq_id in self.engine.seqs:
            self.cancelled.add(seq_id)
            self.wake.set()

    async def _loop(self) -> None:
        while True:
            self._abort_cancelled()
            self._admit()
            self.metrics.running.labels(self.name).set(self.num_running)
            self.metrics.waiting.labels(self.name).set(len(self.waiting))
            if not self.engine.has_unfinished:
                self.wake.clear()
                self.rounds.idle()
                await self.wake.wait()
                continue
            with self.rounds.round():
                await self._round()

    async def _round(self) -> None:
        try:
            if self.clients is not None and not self.busy_elsewhere():
                outputs = await self.thread.run(self._round_now)
                self.rounds_now += 1
            else:
                outputs = await self.engine.step_async()
        except Exception as exc:
            if not isinstance(exc, ServiceUnavailableError) or isinstance(exc, TargetTimeoutError):
                self._fail(list(self.engine.seqs), exc)  # not a failed call: state may be half-committed
                return
            # The verification call failed before anything was committed: one request's input, or a replica that
            # died. Retry the round one sequence at a time (on whichever replica now answers), failing only those
            # whose own round fails again.
            logger.warning("target %s round of %d failed (%s); retrying one by one", self.name,
                           len(self.engine.seqs), exc)
            outputs = await self._rounds_one_by_one()
        for out in outputs:
            if not out.finished and out.seq_id in self.engine.seqs and out.seq_id not in self.queues:
                self.cancelled.add(out.seq_id)  # nobody listens any more
            self._send(out.seq_id, Event(out.new_tokens, out.finished, out.finish_reason, out.metrics,
                                         logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs))

    def _round_now(self) -> list:
        """The engine's round run whole on the model thread, the draft's and the target's calls plain calls: one hop
        instead of one per call, and no batch queue. Only while no other target's round could share the draft's
        forward (`busy_elsewhere`); the state is the same either way, so the next round may go either way."""
        for client in self.clients:
            client.now = True
        try:
            return self.engine.step()
        finally:
            for client in self.clients:
                client.now = False

    async def _rounds_one_by_one(self) -> list:
        everyone, outputs = self.engine.seqs, []
        try:
            for seq_id, seq in list(everyone.items()):
                self.engine.seqs = {seq_id: seq}  # the engine's round runs over its live sequences: just this one
                try:
                    outputs += await self.engine.step_async()
                except Exception as exc:
                    self._fail([seq_id], exc)
                if seq_id not in self.engine.seqs:  # finished or failed
                    del everyone[seq_id]
        finally:
            self.engine.seqs = everyone
        return outputs

    def _fail(self, seq_ids: list[str], exc: Exception) -> None:
        logger.error("target %s: %d sequence(s) failed: %s", self.name, len(seq_ids), exc)
        err = exc if isinstance(exc, S2DError) else ServiceUnavailableError(f"{type(exc).__name__}: {exc}")
        for seq_id in seq_ids:
            self.engine.abort(seq_id)
            self._send(seq_id, Event([], finished=True, error=err))

    def _admit(self) -> None:
        while self.waiting and self.num_running < self.max_running:
            seq_id, req = next(iter(self.waiting.items()))
            del self.waiting[seq_id]
            try:
                self.engine.add_request(req)
            except ValueError as exc:
                self._send(seq_id, Event([], finished=True, error=RequestError(str(exc))))

    def _abort_cancelled(self) -> None:
        for seq_id in self.cancelled:
            self.engine.abort(seq_id)
        self.cancelled.clear()

    def _send(self, seq_id: str, event: Event) -> None:
        queue = self.queues.get(seq_id)
        if queue is not None:
            queue.put_nowait(event)
            if event.finished:
                del self.queues[seq_id]
