"""The router's decode loop for one target: ONE SpecEngine whose drafter and verifier are Ray deployment handles.

Continuous batching: requests queue, join the engine between rounds (up to max_concurrent_sequences), and every
round is one batched propose + one batched verification for all live sequences of the target. All engine mutations
(admit, abort) happen in the loop between rounds, so an abort never races a round that is using the sequence's KV.
If the draft deployment fails, the round runs target-only (empty proposals: still exactly the target's tokens) and
speculation resumes after `retry_after_s`.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import torch

from ..core.engine import GenerationRequest, SpecEngine
from ..core.types import DraftRequest, Proposal, ScoreRequest
from ..errors import CapacityError, RequestError, S2DError, ServiceUnavailableError
from .metrics import ServeMetrics

logger = logging.getLogger(__name__)


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


class DraftClient:
    """The engine's drafter: the shared draft deployment, degrading to target-only rounds while it is down."""

    def __init__(self, handle, target: str, timeout_s: float, retry_after_s: float,
                 on_fallback: Callable[[], None]) -> None:
        self.handle, self.target = handle, target
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self.on_fallback = on_fallback
        self.down_until = 0.0
        self.releases = Releases()

    async def propose(self, drafts: list[DraftRequest]) -> list[Proposal]:
        if time.monotonic() >= self.down_until:
            try:
                return await _bounded(self.handle.propose.remote(self.target, drafts), self.timeout_s)
            except Exception as exc:
                logger.warning("draft failed (%s: %s); target-only for %.0f s", type(exc).__name__, exc,
                               self.retry_after_s)
                self.down_until = time.monotonic() + self.retry_after_s
        self.on_fallback()
        return [Proposal.empty() for _ in drafts]

    def release(self, seq_id: str) -> None:
        self.releases.send(self.handle.release.remote(seq_id), "draft release")


class TargetClient:
    """The engine's verifier: the target deployment; failures and timeouts become ServiceUnavailableError."""

    def __init__(self, handle, name: str, timeout_s: float) -> None:
        self.handle, self.name, self.timeout_s = handle, name, timeout_s
        self.releases = Releases()

    async def score(self, requests: list[ScoreRequest]) -> list[torch.Tensor]:
        try:
            return await _bounded(self.handle.score.remote(requests), self.timeout_s)
        except asyncio.TimeoutError:
            raise ServiceUnavailableError(f"target {self.name} did not answer within {self.timeout_s:.0f} s") from None
        except Exception as exc:
            raise ServiceUnavailableError(f"target {self.name} failed: {type(exc).__name__}") from exc

    def release(self, seq_id: str) -> None:
        self.releases.send(self.handle.release.remote(seq_id), "target release")


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


class TargetScheduler:
    """Admission, the round loop and per-request event queues for one target."""

    def __init__(self, name: str, engine: SpecEngine, max_running: int, max_waiting: int,
                 metrics: ServeMetrics) -> None:
        self.name, self.engine = name, engine  # the engine owns its drafter and verifier clients
        self.max_running, self.max_waiting, self.metrics = max_running, max_waiting, metrics
        self.waiting: dict[str, GenerationRequest] = {}
        self.queues: dict[str, asyncio.Queue[Event]] = {}
        self.cancelled: set[str] = set()
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None

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
                await self.wake.wait()
                continue
            await self._round()

    async def _round(self) -> None:
        try:
            outputs = await self.engine.step_async()
        except Exception as exc:
            logger.error("target %s round failed: %s", self.name, exc)
            err = exc if isinstance(exc, S2DError) else ServiceUnavailableError(f"{type(exc).__name__}: {exc}")
            for seq_id in list(self.engine.seqs):
                self.engine.abort(seq_id)
                self._send(seq_id, Event([], finished=True, error=err))
            return
        for out in outputs:
            if not out.finished and out.seq_id in self.engine.seqs and out.seq_id not in self.queues:
                self.cancelled.add(out.seq_id)  # nobody listens any more
            self._send(out.seq_id, Event(out.new_tokens, out.finished, out.finish_reason, out.metrics,
                                         logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs))

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
