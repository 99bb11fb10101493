"""The router's decode loop for one target: ONE SpecEngine whose drafter and verifier are the deployment clients.

Continuous batching: requests queue, join the engine between rounds (up to max_concurrent_sequences), and every
round is one batched propose + one batched verification for all live sequences of the target. All engine mutations
(admit, abort) happen in the loop between rounds, so an abort never races a round that is using the sequence's KV.
If the draft deployment fails, the round runs target-only (empty proposals: still exactly the target's tokens) and
speculation resumes after `retry_after_s` (`clients.DraftClient`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from typing import Any, Callable

from ..core.engine import GenerationRequest, SpecEngine
from ..errors import CapacityError, RequestError, S2DError, ServiceUnavailableError
from .clients import DeploymentClient, DraftClient, TargetClient, TargetGoneError, TargetTimeoutError
from .events import Event
from .metrics import ServeMetrics
from .replica import ModelThread
from .round_timing import CallTimes, RoundTimes

logger = logging.getLogger(__name__)


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
        self.preparing = 0  # requests holding a reservation (`reserve`) while they are prepared

    def _local_clients(self) -> list[DeploymentClient] | None:
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
        out = {"round": {**self.rounds.summary(), "whole": self.rounds_now},
               "profile": self.engine.profile.summary()}  # ms per token by part: draft, verify, prompt, host
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
        return len(self.engine.live_ids())

    @contextlib.contextmanager
    def reserve(self):
        """A place for one request while it is prepared (tokenized, its grammar compiled): refused with
        CapacityError NOW, before that work, when the running, queued and in-preparation requests fill the target;
        held until the request is submitted (or given up)."""
        self._check_capacity(self.preparing)
        self.preparing += 1
        try:
            yield
        finally:
            self.preparing -= 1

    def _check_capacity(self, extra: int = 0) -> None:
        if len(self.waiting) + self.num_running + extra >= self.max_running + self.max_waiting:
            raise CapacityError(f"target {self.name} is at capacity ({self.max_running} running, "
                                f"{self.max_waiting} queued); retry later")

    def submit(self, req: GenerationRequest) -> asyncio.Queue[Event]:
        """Queue a prepared request (a reserved one always has room: reservations count against capacity)."""
        self._check_capacity()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        self.queues[req.seq_id] = queue
        self.waiting[req.seq_id] = req
        if self.task is None or self.task.done():
            # A fresh context: a task copies its creator's contextvars, which here include Serve's request context
            # of the HTTP request that happened to start the loop. Calls made under it are that request's children,
            # and Serve cancels them when it ends (a cancelled KV release would leak a target row).
            self.task = asyncio.get_running_loop().create_task(self._loop(), context=contextvars.Context())
        self.wake.set()
        return queue

    def cancel(self, seq_id: str) -> None:
        """Client gone or timed out: drop it from the queue, or abort it (freeing KV) before the next round."""
        self.queues.pop(seq_id, None)
        if self.waiting.pop(seq_id, None) is None and seq_id in self.engine.live_ids():
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
            if not isinstance(exc, ServiceUnavailableError) or isinstance(exc, (TargetTimeoutError, TargetGoneError)):
                self._fail(self.engine.live_ids(), exc)  # not a failed call: state may be half-committed
                return
            # The verification call failed before anything was committed: one request's input, or a replica that
            # died. Retry the round one sequence at a time (on whichever replica now answers), failing only those
            # whose own round fails again.
            logger.warning("target %s round of %d failed (%s); retrying one by one", self.name,
                           self.num_running, exc)
            outputs = await self._rounds_one_by_one()
        live = set(self.engine.live_ids())
        for out in outputs:
            if not out.finished and out.seq_id in live and out.seq_id not in self.queues:
                self.cancelled.add(out.seq_id)  # nobody listens any more
            self._send(out.seq_id, Event(out.new_tokens, out.finished, out.finish_reason, out.metrics,
                                         logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs))

    def _round_now(self) -> list:
        """The engine's round run whole on the model thread, the draft's and the target's calls plain calls: one hop
        instead of one per call, and no batch queue. Only while no other target's round could share the draft's
        forward (`busy_elsewhere`); the state is the same either way, so the next round may go either way."""
        with contextlib.ExitStack() as stack:
            for client in self.clients:
                stack.enter_context(client.on_model_thread())
            return self.engine.step()

    async def _rounds_one_by_one(self) -> list:
        """The round again, one live sequence at a time; a sequence whose own round fails is failed alone."""
        outputs = []
        for seq_id in self.engine.live_ids():
            try:
                outputs += await self.engine.step_async(only=[seq_id])
            except Exception as exc:
                self._fail([seq_id], exc)
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
