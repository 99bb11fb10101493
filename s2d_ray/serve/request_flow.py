"""One request's life in the router, HTTP or handle: admitted (limits, a decode slot or 429), prepared off the event
loop, submitted to its target's scheduler in its tenant's cache scope, then one chunk per round until it finishes; a
timeout, an error or a vanished client aborts its sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from ..errors import ModelNotFoundError, RequestTimeoutError
from .admission import PreparedGroup, Preparer
from .app_config import AppConfig
from .events import Event, coalesced
from .lora import RouterAdapters
from .metrics import ServeMetrics
from .metrics_hub import HubPusher
from .openai_protocol import GenerateChunk, GenerateRequest, GenerateResponse, Usage
from .prepare import ModelInfo, TextAssembler, to_generation
from .request_limits import check_request_limits, heavy_request
from .scheduler import TargetScheduler
from .tenants import TenantKeys, scoped_seq_id, store_scope


@dataclass
class RequestFlow:
    """What a request passes through in one router replica. `models` and `schedulers` are the router's own dicts:
    a runtime LoRA load (serve/lora.py) adds its model name to them and the flow serves it at once."""

    cfg: AppConfig
    models: dict[str, ModelInfo]
    schedulers: dict[str, TargetScheduler]
    adapters: RouterAdapters
    tenants: TenantKeys
    preparer: Preparer
    metrics: ServeMetrics
    pusher: HubPusher

    def info(self, model: str) -> ModelInfo:
        """The served model `model` names (a target or a loaded adapter), or a 404."""
        info = self.models.get(model)
        if info is None:
            raise ModelNotFoundError(f"model {model!r} is not served here; available: {sorted(self.models)}")
        return info

    async def generate(self, req: GenerateRequest, group: PreparedGroup | None = None,
                       index: int = 0) -> GenerateResponse:
        info = self.info(req.model)  # as admitted: an adapter unloaded meanwhile lets this request finish
        async with contextlib.aclosing(self.run(req, group, index)) as stream:
            chunks = [c async for c in stream]
        ids, first, last = [t for c in chunks for t in c.token_ids], chunks[0], chunks[-1]
        # The text is decoded from all ids at once, independently of the streamed deltas.
        assembler = TextAssembler(info, tuple(req.stop_list), ids, req.min_tokens)
        logprobs = [e for c in chunks for e in c.logprobs or []] if req.logprobs is not None else None
        return GenerateResponse(model=req.model, text=assembler.final_text(), token_ids=ids,
                                finish_reason=last.finish_reason, usage=last.usage, metrics=last.metrics,
                                logprobs=logprobs, prompt_token_ids=first.prompt_token_ids,
                                prompt_logprobs=first.prompt_logprobs)

    async def run(self, req: GenerateRequest, group: PreparedGroup | None = None,
                  index: int = 0) -> AsyncIterator[GenerateChunk]:
        """Admit (limits checked; prepared alone, or as choice `index` of `group`), then one chunk per round; the last
        carries usage and the engine's metrics."""
        info = self.info(req.model)
        self.pusher.start()
        if group is None:  # a handle call; an HTTP request was checked once before its choices were made
            check_request_limits(req, self.cfg.limits)
        base, _ = self.adapters.target(req.model)  # an adapter's rows decode on its base's engine
        sched = self.schedulers[base]
        arrival, first_token = time.perf_counter(), None
        # a full target answers 429 before any tokenizing or compiling; an adapter's request counts as its use from
        # here (an unload waits for it, serve/lora.py), in the scheduler once submitted
        with sched.reserve(), self.adapters.preparing(req.model):
            if group is None:
                gen = await self.preparer.run(to_generation, info, req, self.cfg.limits, heavy=heavy_request(req))
            else:
                gen = await group.get(index)
            # The caches read only the request's scope: its tenant and cache_salt (tenants.py); the store of earlier
            # outputs under `suffix.scope: api_key` also its end user.
            scope = self.tenants.cache_scope(req.tenant, req.cache_salt)
            end_user = req.suffix_scope if self.cfg.suffix.scope == "api_key" else None
            gen = replace(gen, seq_id=scoped_seq_id(scope, gen.seq_id), suffix_scope=store_scope(scope, end_user))
            _, gen = self.adapters.generation(req.model, gen)
            text = TextAssembler(info, gen.stop_strings, min_tokens=gen.min_tokens)
            # Nothing awaits between the submit and _events' try: a closed stream always aborts its sequence.
            events = self.events(sched, gen, sched.submit(gen))
        drop = req.max_tokens == 0  # scoring only: the one decoded token is not returned
        if self.cfg.router.stream_interval > 1:
            events = coalesced(events, self.cfg.router.stream_interval)
        async with contextlib.aclosing(events) as events:
            async for ev in events:
                if ev.tokens and first_token is None:
                    first_token = time.perf_counter() - arrival
                tokens, logprobs = ([], [] if ev.logprobs is not None else None) if drop else (ev.tokens, ev.logprobs)
                prompt = {}
                if ev.prompt_logprobs is not None:
                    prompt = {"prompt_token_ids": gen.prompt_ids, "prompt_logprobs": ev.prompt_logprobs}
                if not ev.finished:
                    delta = text.push(tokens)
                    if tokens or prompt:
                        yield GenerateChunk(text=delta, token_ids=tokens, logprobs=logprobs, **prompt)
                    continue
                delta = text.finish(tokens)
                n_out = len(text.ids)
                usage = Usage(prompt_tokens=len(gen.prompt_ids), completion_tokens=n_out,
                              total_tokens=len(gen.prompt_ids) + n_out)
                self.metrics.record_finished(req.model, len(gen.prompt_ids), ev.finish_reason or "abort", ev.metrics,
                                             time.perf_counter() - arrival, first_token)
                yield GenerateChunk(text=delta, token_ids=tokens, finish_reason=ev.finish_reason,
                                    usage=usage, metrics=ev.metrics, logprobs=logprobs, **prompt)

    async def events(self, sched: TargetScheduler, gen, queue: asyncio.Queue) -> AsyncIterator[Event]:
        """The submitted request's events until it finishes; on timeout, error or a vanished client the sequence is
        aborted."""
        deadline = time.monotonic() + self.cfg.limits.request_timeout_s
        finished, reason = False, "cancelled"  # client gone (CancelledError / generator closed) unless set below
        try:
            while not finished:
                try:
                    ev = await asyncio.wait_for(queue.get(), max(deadline - time.monotonic(), 0.0))
                except asyncio.TimeoutError:
                    reason = "timeout"
                    raise RequestTimeoutError(
                        f"request exceeded {self.cfg.limits.request_timeout_s:.0f} s and was aborted") from None
                if ev.error is not None:
                    reason = "error"
                    raise ev.error
                finished = ev.finished
                yield ev
        finally:
            if not finished:
                sched.cancel(gen.seq_id)
                self.metrics.aborts.labels(sched.name, reason).inc()
