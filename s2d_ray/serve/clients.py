"""The router's clients of the draft and target deployments: the engine's drafter and verifier, over Ray handles.

A round is one call per replica its sequences' affinity keys prefer (`affinity.split_call`: the replica holding each
sequence) and carries, per request, how many tokens an earlier round already computed (the replica reports what it had
to recompute). A deployment placed in the router's own process (`InProcessHandle`) is called the same way, or, while
the scheduler runs a round whole on the process's model thread (`on_model_thread`), with plain calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Awaitable, Callable, Iterator

import torch

from ..core.types import DraftRequest, Proposal, ScoreRequest
from ..errors import ServiceUnavailableError
from .affinity import Affinity, live_replicas, split_call
from .draft_deadline import DeadlinePolicy, DraftDeadline, drafted_positions
from .replica import InProcessHandle
from .round_timing import CallTimes

logger = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 30.0


class TargetTimeoutError(ServiceUnavailableError):
    """The target did not answer in time; its rounds are not retried (each retry would wait as long again)."""


class TargetGoneError(ServiceUnavailableError):
    """No replica of the target answered within its `failover_s` after the one holding a call was lost; like a
    timeout, the round is not retried (each retry would wait as long again)."""


FAILOVER_BACKOFF_S = (0.05, 0.2, 0.5, 1.0)  # between resends of a lost call: Serve needs a moment to drop the replica


def replica_lost(exc: BaseException) -> bool:
    """Whether a failed call lost the replica that held it (its process or node died, Serve has no replica for it,
    or its tensor-parallel group broke and is being replaced), not failed on its input: the call may be sent again,
    to whichever replica answers, since it carries every token of its sequences."""
    from ray.exceptions import NodeDiedError, RayActorError, WorkerCrashedError
    from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

    from .tp import TPGroupError

    return isinstance(exc, (RayActorError, NodeDiedError, WorkerCrashedError, DeploymentUnavailableError,
                            ReplicaUnavailableError, TPGroupError))


async def bounded(awaitable: Awaitable, timeout_s: float) -> Any:
    """`awaitable` (a coroutine or a Ray response) awaited for at most `timeout_s`."""
    async def wait() -> Any:
        return await awaitable

    return await asyncio.wait_for(wait(), timeout_s)


class Releases:
    """KV releases nobody waits for: sent at once, bounded, failures logged (a dead replica has no state left)."""

    def __init__(self) -> None:
        self._pending: set[asyncio.Task] = set()  # strong references until done (asyncio keeps only weak ones)

    def send(self, awaitable: Awaitable, what: str) -> None:
        async def run() -> None:
            try:
                await bounded(awaitable, RELEASE_TIMEOUT_S)
            except Exception as exc:
                logger.debug("%s failed: %s", what, exc)

        task = asyncio.ensure_future(run())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)


class DeploymentClient:
    """What the draft and target clients share: affinity bookkeeping, per-call timing, fire-and-forget releases,
    and plain calls while the caller is on the model thread of a deployment placed in this process (`local`)."""

    role = "deployment"

    def __init__(self, handle: Any, affinity: Affinity, times: CallTimes | None, local: Any) -> None:
        self.handle, self.affinity = handle, affinity
        self.times = times or CallTimes()
        self.releases = Releases()
        self.local = local  # the deployment object in this process, or None
        self.now = False  # whether the caller is on the model thread now (see on_model_thread)

    @contextlib.contextmanager
    def on_model_thread(self) -> Iterator[None]:
        """While a round runs whole on the process's model thread: calls are plain calls on `local`."""
        self.now = True
        try:
            yield
        finally:
            self.now = False

    def _seen(self, rows: list[DraftRequest] | list[ScoreRequest]) -> list[int]:
        return [self.affinity.expected(r.seq_id, r.tokens) for r in rows]

    async def _split(self, rows: list, timeout_s: float, call: Callable[[list[int], str | None], Awaitable]) -> list:
        replicas = live_replicas(self.handle)  # a new sequence is placed by its prompt (affinity.PrefixRoutingConfig)
        keys = [self.affinity.key_for(r.seq_id, r.tokens, self._committed(r), replicas, getattr(r, "adapter", ""))
                for r in rows]
        return await bounded(split_call(self.handle, keys, call), timeout_s)

    @staticmethod
    def _committed(row: DraftRequest | ScoreRequest) -> int:
        """Leading tokens of a call that are the sequence's own (a score call's last num_logits - 1 are drafts)."""
        return len(row.tokens) - (row.num_logits - 1 if isinstance(row, ScoreRequest) else 0)

    def _gathered(self, n: int, parts: list[tuple[list[int], Any]], start: float) -> list:
        self.times.add_slowest(time.perf_counter() - start, (reply for _, reply in parts))
        return self.affinity.gathered(parts, n)

    def release(self, seq_id: str) -> None:
        key = self.affinity.key_for(seq_id)  # before forgetting: the release goes where the sequence was placed
        self.affinity.forget(seq_id)
        what = f"{self.role} release"
        if self.now:
            try:  # on the model thread, during a round run there whole; failures logged like `Releases`
                self.local.release_now(seq_id)
            except Exception as exc:
                logger.debug("%s failed: %s", what, exc)
            return
        self.releases.send(self.handle.release.remote(seq_id, affinity=key), what)


class DraftClient(DeploymentClient):
    """The engine's drafter: the shared draft deployment, degrading to target-only rounds (empty proposals: still
    exactly the target's tokens) after a failed or late call, for a backoff (draft_deadline.py); the wait for a call
    follows the draft's measured speed, at most `timeout_s`."""

    role = "draft"

    def __init__(self, handle: Any, target: str, timeout_s: float, retry_after_s: float,
                 on_fallback: Callable[[], None], affinity: Affinity | None = None,
                 times: CallTimes | None = None, deadline: DraftDeadline | None = None) -> None:
        local = handle.local if isinstance(handle, InProcessHandle) else None  # draft.placement: router
        super().__init__(handle, affinity or Affinity(None, "draft"), times, local)
        self.target = target
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self.on_fallback = on_fallback
        self.deadline = deadline or DraftDeadline(DeadlinePolicy(timeout_s, retry_after_s))
        self.down_until = 0.0

    def propose(self, drafts: list[DraftRequest]) -> list[Proposal] | Awaitable[list[Proposal]]:
        return self._propose_now(drafts) if self.now else self._propose(drafts)

    async def _propose(self, drafts: list[DraftRequest]) -> list[Proposal]:
        if time.monotonic() >= self.down_until:
            seen = self._seen(drafts)
            start = time.perf_counter()

            def call(idx: list[int], key: str | None):
                return self.handle.propose.remote(self.target, [drafts[i] for i in idx], [seen[i] for i in idx],
                                                  affinity=key)

            positions = drafted_positions(drafts, seen)
            try:
                parts = await self._split(drafts, self.deadline.timeout(positions), call)
            except Exception as exc:
                self._down(exc)
            else:
                self.deadline.succeeded(time.perf_counter() - start, positions)
                return self._answered(drafts, parts, start)
        self.on_fallback()
        return [Proposal.empty() for _ in drafts]

    def _propose_now(self, drafts: list[DraftRequest]) -> list[Proposal]:
        if time.monotonic() >= self.down_until:
            seen = self._seen(drafts)
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
        wait = self.deadline.failed()
        logger.warning("draft failed (%s: %s); target-only for %.1f s", type(exc).__name__, exc, wait)
        self.down_until = time.monotonic() + wait

    def _answered(self, drafts: list[DraftRequest], parts: list[tuple[list[int], Any]],
                  start: float) -> list[Proposal]:
        results = self._gathered(len(drafts), parts, start)
        for d, p in zip(drafts, results):
            # A chain: the drafter ran every proposed token but the last through its first layers; a tree
            # (siblings are not a sequence): count only the prefix, which it surely holds.
            if p.tokens:
                self.affinity.computed(d.seq_id, d.tokens + p.tokens[:-1] if p.parents is None else d.tokens)
        return results


class TargetClient(DeploymentClient):
    """The engine's verifier: the target deployment; failures and timeouts become ServiceUnavailableError."""

    role = "target"

    def __init__(self, handle: Any, name: str, timeout_s: float, affinity: Affinity | None = None,
                 times: CallTimes | None = None, failover_s: float = 0.0,
                 on_failover: Callable[[], None] | None = None) -> None:
        local = handle.local if isinstance(handle, InProcessHandle) else None
        # Plain calls need the whole model in this process (placement: router, tp_size 1).
        super().__init__(handle, affinity or Affinity(None, f"target-{name}"), times,
                         local if getattr(local, "inline", False) else None)
        self.name, self.timeout_s = name, timeout_s
        self.failover_s = failover_s
        self.on_failover = on_failover or (lambda: None)

    def score(self, requests: list[ScoreRequest]) -> list[torch.Tensor] | Awaitable[list[torch.Tensor]]:
        return self._score_now(requests) if self.now else self._score(requests)

    async def _score(self, requests: list[ScoreRequest]) -> list[torch.Tensor]:
        seen = self._seen(requests)
        start = time.perf_counter()
        placed = live_replicas(self.handle) != ()  # () : Serve knows no replica of the target (yet, or any more)

        def call(idx: list[int], key: str | None):
            return self._resent(lambda: self.handle.score.remote([requests[i] for i in idx], [seen[i] for i in idx],
                                                                 affinity=key), placed)

        try:  # each call is bounded in _resent (its first send, then its failover); this is only a backstop
            parts = await self._split(requests, self.timeout_s + self.failover_s + FAILOVER_BACKOFF_S[-1], call)
        except asyncio.TimeoutError:
            raise TargetTimeoutError(f"target {self.name} did not answer within {self.timeout_s:.0f} s") from None
        except (TargetGoneError, TargetTimeoutError):
            raise
        except Exception as exc:
            raise ServiceUnavailableError(f"target {self.name} failed: {type(exc).__name__}") from exc
        return self._answered(requests, parts, start)

    async def _resent(self, send: Callable[[], Awaitable], placed: bool) -> Any:
        """One replica's share of a round, sent again while its replica is lost (`replica_lost`), for `failover_s`:
        the call carries its sequences' tokens, so the replica that takes it (a survivor, or the replacement Serve
        starts on another node) rebuilds their KV from the prompt and the committed tokens and the round goes on
        exactly. Only this share is resent: the other replicas' shares of the round have answered. The first send
        is bounded by `timeout_s` (a slow replica is not resent to: the resend would wait as long again); a resend,
        or a first send while no replica is `placed`, waits for a replica only until `failover_s` after the loss
        (Serve holds calls while a deployment has none), so a target that cannot be placed again is a 503 with
        Retry-After, not a hang."""
        attempt = 0
        deadline = time.monotonic() + self.failover_s  # moved to the loss, when one happens
        while True:
            first = attempt == 0 and (placed or not self.failover_s)
            try:
                return await bounded(send(), self.timeout_s if first else max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                if first:
                    raise TargetTimeoutError(
                        f"target {self.name} did not answer within {self.timeout_s:.0f} s") from None
                raise self._gone("no replica took the call") from None
            except Exception as exc:
                if not replica_lost(exc):
                    raise
                if attempt == 0:
                    deadline = time.monotonic() + self.failover_s
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._gone(f"a replica was lost ({type(exc).__name__})") from exc
                logger.warning("target %s: replica lost (%s); resending the call (attempt %d)", self.name,
                               type(exc).__name__, attempt + 1)
                self.on_failover()
                await asyncio.sleep(min(FAILOVER_BACKOFF_S[min(attempt, len(FAILOVER_BACKOFF_S) - 1)], left))
                attempt += 1

    def _gone(self, why: str) -> TargetGoneError:
        return TargetGoneError(f"target {self.name} unavailable: {why} and none answered within {self.failover_s:.0f} "
                               "s", retry_after_s=max(self.failover_s, 1.0))

    def _score_now(self, requests: list[ScoreRequest]) -> list[torch.Tensor]:
        seen = self._seen(requests)
        start = time.perf_counter()
        try:
            reply = self.local.score_now(requests, seen)
        except Exception as exc:
            raise ServiceUnavailableError(f"target {self.name} failed: {type(exc).__name__}") from exc
        return self._answered(requests, [(list(range(len(requests))), reply)], start)

    def _answered(self, requests: list[ScoreRequest], parts: list[tuple[list[int], Any]],
                  start: float) -> list[torch.Tensor]:
        results = self._gathered(len(requests), parts, start)
        for r, res in zip(requests, results):
            if r.steps > 1:  # plain steps: the replica also computed every chosen token but the last
                self.affinity.computed(r.seq_id, r.tokens + res.tolist()[:-1])
            else:  # a tree's nodes are not a sequence: count its prefix only (compacted on the next call)
                kept = r.tokens if r.parents is None else r.tokens[: len(r.tokens) - len(r.parents)]
                self.affinity.computed(r.seq_id, kept)
        return results
