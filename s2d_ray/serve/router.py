"""The ingress: OpenAI-compatible HTTP API, the Python handle API, /health and /metrics.

It holds tokenizers only; per target it owns one TargetScheduler (one SpecEngine + one decode loop) whose drafter is
the shared draft deployment and whose verifier is the target deployment.
"""

# No `from __future__ import annotations` here: Serve's ingress re-creates the route methods and FastAPI must see
# real annotation objects (a string "Request" would be taken for a query parameter).
import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from dataclasses import replace
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..build import assemble_engine, draft_base_source, load_profile, set_threads
from ..errors import ModelNotFoundError, RequestTimeoutError, S2DError
from ..gc_pauses import gc_pauses
from ..models import check_same_vocabulary
from .affinity import Affinity, each_replica
from .app_config import AppConfig
from .choices import first_items, gather_all, merge
from .clients import DraftClient, TargetClient
from .events import Event, coalesced
from .http_api import (
    ApiError, api_error, authorize, body_schema, error_response, parse_body, read_body, store_scope,
    validation_error,
)
from .loaders import load_tokenizer
from .metrics import ServeMetrics, prefix_cache_totals
from .openai_protocol import (
    ChatCompletionRequest, ChoiceView, CompletionRequest, GenerateChunk, GenerateRequest, GenerateResponse,
    ResponseIds, Usage, error_body, full_response, stream_chunk, total_usage, usage_chunk,
)
from ..token_bytes import token_bytes_fn
from .prepare import ModelInfo, TextAssembler, encode, to_generation
from .replica import InProcessHandle, device_report, process_model_thread, replica_id, target_window
from .round_timing import CallTimes
from .scheduler import TargetScheduler

logger = logging.getLogger(__name__)


app = FastAPI(title="s2d-ray", description="Sorted speculative decoding served on Ray (OpenAI-compatible).")


@app.exception_handler(ApiError)
async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc)


@app.exception_handler(RequestValidationError)
async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(validation_error(exc))


@app.exception_handler(StarletteHTTPException)
async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(ApiError(exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else None))


STATS_TIMEOUT_S = 5.0  # one deployment's stats call; a dead replica is reported after this, not waited on


async def _call_stats(handle, key: str | None = None) -> dict:
    """A deployment's stats (the replica `key` is pinned to), or the error that prevented them (bounded: a dead
    replica must not hang /health)."""
    try:
        call = handle.stats.remote(affinity=key) if key else handle.stats.remote()
        return await asyncio.wait_for(_await(call), STATS_TIMEOUT_S)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


async def _replica_stats(handle) -> list[dict]:
    """Every live replica's stats (the prefix cache counters live in each), the first one answered as before."""
    return await each_replica(handle, lambda key: _call_stats(handle, key))


async def _await(response):
    return await response


# Serve serializes the class when it is decorated: everything its methods use must be defined above this line.
@serve.deployment(name="router")
@serve.ingress(app)
class Router:
    def __init__(self, cfg: AppConfig, draft, targets: dict) -> None:
        gc_pauses()  # this process's collections, loading included
        set_threads(1)
        self.cfg = cfg
        key = cfg.api_key.get_secret_value() if cfg.api_key else os.environ.get("S2D_API_KEY")
        self._api_key = key or None
        self.metrics = ServeMetrics()
        if draft is None and cfg.uses_draft:  # draft.placement: router
            from .draft_deployment import draft_in_router

            draft = draft_in_router(cfg)
        if cfg.placed_targets:
            from .target_deployment import target_in_router

            targets = {**targets, **{name: target_in_router(cfg, name) for name in cfg.placed_targets}}
        self.draft_handle, self.target_handles = draft, targets
        self._in_process = [h for h in [*targets.values(), draft] if isinstance(h, InProcessHandle)]
        self.affinity = uuid.uuid4().hex  # this router's routing key: its rounds stay on one replica per deployment
        self.affinities: list[Affinity] = []  # every client's, for /health's recomputed_tokens
        self.replica = replica_id()
        self.models = {t.name: self._model_info(t.name) for t in cfg.targets}
        if cfg.uses_draft:
            base = load_tokenizer(draft_base_source(cfg.draft.source, cfg.draft.base_model), cfg.cache_dir,
                                  cfg.trust_remote_code)
            for info in self.models.values():
                check_same_vocabulary(base, info.tokenizer, f"draft {cfg.draft.source}", f"target {info.name}")
        self.schedulers = {name: self._scheduler(name) for name in self.models}
        logger.info("router: targets %s (sequences admitted at once %s), draft %s, auth %s", sorted(self.models),
                    {n: s.max_running for n, s in self.schedulers.items()},
                    cfg.draft.source if cfg.uses_draft else None, "on" if self._api_key else "off")

    def _model_info(self, name: str) -> ModelInfo:
        spec = self.cfg.target(name)
        tok = load_tokenizer(spec.resolved_source, self.cfg.cache_dir, self.cfg.trust_remote_code, spec.chat_template)
        ctx = target_window(self.cfg, name)
        eos = tuple(i for i in {tok.eos_token_id} if i is not None)
        return ModelInfo(name, tok, ctx, eos)

    def _scheduler(self, name: str) -> TargetScheduler:
        cfg, info, spec = self.cfg, self.models[name], self.cfg.target(name)
        ecfg = cfg.engine_config(name)
        target, draft = self._target_client(name), self._draft_client(name) if cfg.uses_draft else None
        engine = assemble_engine(ecfg, target, draft, load_profile(ecfg), info.max_context, info.detokenize,
                                 plain_steps=spec.plain_steps if spec.tp_size == 1 else 1)
        # Rounds run whole on the process's model thread while no other target of this router has work (the
        # draft and target must both be in this process; `router.whole_rounds`).
        thread = process_model_thread(cfg.num_threads) if cfg.router.whole_rounds and self._in_process else None
        return TargetScheduler(name, engine, cfg.max_sequences(name), cfg.limits.max_queued_requests, self.metrics,
                               thread, busy_elsewhere=lambda: self._busy_besides(name))

    def _target_client(self, name: str) -> TargetClient:
        """The engine's verifier for one target: its calls' overhead observed in s2d:call_overhead_seconds."""
        affinity = Affinity(self.affinity, f"target-{name}", self.metrics.recomputed_tokens, self._routing)
        self.affinities.append(affinity)
        times = CallTimes(observe=self.metrics.call_overhead.labels(name, "target").observe)
        return TargetClient(self.target_handles[name], name, self.cfg.limits.score_timeout_s, affinity, times)

    def _draft_client(self, name: str) -> DraftClient:
        """One target's client of the shared draft: its fallback rounds counted, its calls' overhead observed."""
        affinity = Affinity(self.affinity, "draft", self.metrics.recomputed_tokens, self._routing)
        self.affinities.append(affinity)
        times = CallTimes(observe=self.metrics.call_overhead.labels(name, "draft").observe)
        return DraftClient(self.draft_handle, name, self.cfg.draft.call_timeout_s, self.cfg.draft.retry_after_s,
                           on_fallback=self.metrics.draft_fallbacks.labels(name).inc, affinity=affinity, times=times)

    @property
    def _routing(self):
        """Prefix routing for new sequences; none without a prefix cache (nothing to land on)."""
        return self.cfg.router.prefix_routing if self.cfg.prefix_cache.enabled else None

    def _busy_besides(self, name: str) -> bool:
        """Whether another target's scheduler has sequences or requests (its rounds could share the draft's forward
        with this one's)."""
        return any(s.engine.has_unfinished or s.waiting for n, s in self.schedulers.items() if n != name)

    # --- the Python handle API ------------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest | dict) -> GenerateResponse:
        """`await handle.generate.remote(GenerateRequest(...))`: the whole completion."""
        req = GenerateRequest.model_validate(request)
        async with contextlib.aclosing(self._run(req)) as stream:
            chunks = [c async for c in stream]
        ids, first, last = [t for c in chunks for t in c.token_ids], chunks[0], chunks[-1]
        # The text is decoded from all ids at once, independently of the streamed deltas.
        assembler = TextAssembler(self.models[req.model], tuple(req.stop_list), ids, req.min_tokens)
        logprobs = [e for c in chunks for e in c.logprobs or []] if req.logprobs is not None else None
        return GenerateResponse(model=req.model, text=assembler.final_text(), token_ids=ids,
                                finish_reason=last.finish_reason, usage=last.usage, metrics=last.metrics,
                                logprobs=logprobs, prompt_token_ids=first.prompt_token_ids,
                                prompt_logprobs=first.prompt_logprobs)

    async def generate_stream(self, request: GenerateRequest | dict) -> AsyncIterator[GenerateChunk]:
        """`handle.options(stream=True).generate_stream.remote(...)`: one chunk per round."""
        req = GenerateRequest.model_validate(request)
        async with contextlib.aclosing(self._run(req)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def stats(self) -> dict:
        """Router queues plus each deployment's live-sequence count (tests check KV is freed after disconnects)."""
        out: dict = {"router": self.replica, "targets": {}, **device_report(None)}  # rounds' sampling: CPU
        # Every deployment is asked at once: one dead replica costs its own bounded wait, not the sum of all of them.
        # The router's own counts are read before the calls: the deployments answer at once too, so the snapshot is
        # of one moment, not of the slowest deployment's answer (a request could finish in between).
        names = list(self.schedulers)
        for name in names:
            sched = self.schedulers[name]
            out["targets"][name] = {"running": sched.num_running, "waiting": len(sched.waiting),
                                    "timing": sched.timing()}
            if sched.engine.suffix is not None:  # the store of earlier outputs lives in this router's engine
                out["targets"][name]["suffix"] = sched.engine.suffix.stats()
        handles = [self.target_handles[n] for n in names] + ([self.draft_handle] if self.cfg.uses_draft else [])
        answers = await asyncio.gather(*(_replica_stats(h) for h in handles[:len(names)]),
                                       *(_call_stats(h) for h in handles[len(names):]))
        for name, reps in zip(names, answers):
            out["targets"][name]["deployment"] = reps[0]
            out["targets"][name]["prefix_cache"] = prefix_cache_totals(reps)
        out["draft"] = answers[-1] if self.cfg.uses_draft else None
        out["recomputed_tokens"] = self._recomputed()
        out["gc"] = gc_pauses().snapshot()  # this process's (placed models included)
        return out

    def _recomputed(self) -> dict[str, dict[str, int]]:
        """deployment -> replica -> tokens recomputed for this router's calls (s2d_recomputed_tokens_total)."""
        out: dict[str, dict[str, int]] = {}
        for aff in self.affinities:
            per_replica = out.setdefault(aff.deployment, {})
            for replica, n in aff.recomputed.items():
                per_replica[replica] = per_replica.get(replica, 0) + n
        return out

    # --- HTTP ---------------------------------------------------------------------------------------------------
    @app.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
    async def completions(self, request: Request) -> Response:
        return await self._openai(request, CompletionRequest, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
    async def chat_completions(self, request: Request) -> Response:
        return await self._openai(request, ChatCompletionRequest, chat=True)

    @app.get("/v1/models")
    async def list_models(self, request: Request) -> dict:
        authorize(request, self._api_key)
        return {"object": "list", "data": [
            {"id": m.name, "object": "model", "created": 0, "owned_by": "s2d-ray", "max_model_len": m.max_context}
            for m in self.models.values()]}

    @app.get("/health")
    async def health(self) -> JSONResponse:
        """200 when every target deployment answers within STATS_TIMEOUT_S (a failing draft is reported, not fatal:
        requests go on target-only); 503 with the failures otherwise."""
        try:  # each deployment's call is bounded at STATS_TIMEOUT_S and they run at once; this bounds the rest
            stats = await asyncio.wait_for(self.stats(), STATS_TIMEOUT_S + 5.0)
        except Exception as exc:
            return JSONResponse({"status": "unhealthy", "error": f"{type(exc).__name__}: {exc}"}, status_code=503)
        bad = [n for n, t in stats["targets"].items() if "error" in t["deployment"]]
        if stats["draft"] is not None and "error" in stats["draft"]:
            bad.append("draft")  # requests still succeed (target-only), so report but stay 200
        status = 503 if any(n != "draft" for n in bad) else 200
        return JSONResponse({"status": "ok" if not bad else "degraded", "failing": bad, **stats}, status_code=status)

    async def check_health(self) -> None:
        """Serve's periodic check: the draft and targets placed here answer on their model threads, and their idle
        state is dropped."""
        for handle in self._in_process:
            await handle.check_health.remote()

    @app.get("/metrics")
    async def prometheus(self) -> Response:
        if self.cfg.uses_draft:
            self.metrics.record_draft(await _call_stats(self.draft_handle))
        for name in self.schedulers:  # the prefix cache counters live in the target replicas
            for stats in await _replica_stats(self.target_handles[name]):
                self.metrics.record_prefix_cache(name, stats)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def _openai(self, request: Request, kind: type[CompletionRequest | ChatCompletionRequest],
                      chat: bool) -> Response:
        model = "unknown"
        try:
            authorize(request, self._api_key)
            oreq = parse_body(await read_body(request, self.cfg.limits.max_body_bytes), kind)
            try:
                greqs = oreq.to_generate(self.cfg.limits.max_choices)  # one per choice
            except ValidationError as exc:
                raise validation_error(exc) from None
            if self.cfg.suffix.enabled and self.cfg.suffix.scope == "api_key":
                scope = store_scope(request, oreq.user, oreq.safety_identifier)
                greqs = [g.model_copy(update={"suffix_scope": scope}) for g in greqs]
            info = self._info(oreq.model)
            model = info.name
            ids = ResponseIds(chat)
            views = [self._view(ids, i, g, oreq, info) for i, g in enumerate(greqs)]
            if oreq.stream:
                streams = [self._run(g) for g in greqs]
                firsts = await first_items(streams)  # admission errors (404, 400, 429) still get an HTTP status
                return StreamingResponse(self._sse(ids, model, views, firsts, streams, oreq.n),
                                         media_type="text/event-stream")
            resps = await gather_all([self.generate(g) for g in greqs])
            return JSONResponse(full_response(ids, model, views, resps, oreq.n))
        except Exception as exc:
            err = api_error(exc)
            if err.status >= 500 and not isinstance(exc, (ApiError, S2DError)):
                logger.exception("unexpected error")
            self.metrics.errors.labels(model, str(err.status)).inc()
            return error_response(err)

    def _info(self, model: str) -> ModelInfo:
        info = self.models.get(model)
        if info is None:
            raise ModelNotFoundError(f"model {model!r} is not served here; available: {sorted(self.models)}")
        return info

    @staticmethod
    def _view(ids: ResponseIds, index: int, greq: GenerateRequest, oreq, info: ModelInfo) -> ChoiceView:
        echo = None
        if getattr(oreq, "echo", False):
            # Token ids are checked (a 400) before they are decoded: the tokenizer fails on ids outside its vocabulary.
            echo = greq.prompt if greq.prompt is not None else info.tokenizer.decode(encode(info, greq))
        return ChoiceView(ids, index, lambda t: info.tokenizer.decode([t]), greq.logprobs is not None, echo,
                          oreq.return_token_ids, greq.tool_mode, token_bytes_fn(info.tokenizer))

    async def _sse(self, ids: ResponseIds, model: str, views: list[ChoiceView], firsts: list[GenerateChunk],
                   streams: list[AsyncIterator[GenerateChunk]], n: int) -> AsyncIterator[str]:
        """One chunk per round per choice; several choices end with one usage chunk. Closing this (the client
        hung up) closes every choice's stream, which aborts its sequence."""
        single, finals = len(streams) == 1, {}
        async with contextlib.aclosing(merge(firsts, streams)) as chunks:
            try:
                async for i, chunk, first in chunks:
                    if chunk.usage is not None:
                        finals[i] = chunk
                    yield f"data: {json.dumps(stream_chunk(ids, model, views[i], chunk, first, single))}\n\n"
                if not single:
                    parts = [finals[i] for i in sorted(finals)]
                    body = usage_chunk(ids, model, total_usage(parts, n), [p.metrics for p in parts])
                    yield f"data: {json.dumps(body)}\n\n"
            except Exception as exc:  # after the first byte the status is sent: report in-band, like OpenAI
                err = api_error(exc)
                self.metrics.errors.labels(model, str(err.status)).inc()
                yield f"data: {json.dumps(error_body(err.message, err.code, err.param, err.type))}\n\n"
        yield "data: [DONE]\n\n"

    # --- one request, HTTP or handle ---------------------------------------------------------------------------
    async def _run(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Admit (limits checked), then one chunk per round; the last carries usage and the engine's metrics."""
        info = self._info(req.model)
        gen = to_generation(info, req, self.cfg.limits)
        if req.suffix_scope and self.cfg.suffix.scope == "api_key":  # `global`: every request shares one store
            gen = replace(gen, suffix_scope=req.suffix_scope)
        sched = self.schedulers[req.model]
        arrival, first_token = time.perf_counter(), None
        text = TextAssembler(info, gen.stop_strings, min_tokens=gen.min_tokens)
        drop = req.max_tokens == 0  # scoring only: the one decoded token is not returned
        events = self._events(sched, gen)
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
                delta = text.push(tokens)
                if not ev.finished:
                    if tokens or prompt:
                        yield GenerateChunk(text=delta, token_ids=tokens, logprobs=logprobs, **prompt)
                    continue
                n_out = len(text.ids)
                usage = Usage(prompt_tokens=len(gen.prompt_ids), completion_tokens=n_out,
                              total_tokens=len(gen.prompt_ids) + n_out)
                self.metrics.record_finished(req.model, len(gen.prompt_ids), ev.finish_reason or "abort", ev.metrics,
                                             time.perf_counter() - arrival, first_token)
                yield GenerateChunk(text=delta + text.finish(), token_ids=tokens, finish_reason=ev.finish_reason,
                                    usage=usage, metrics=ev.metrics, logprobs=logprobs, **prompt)

    async def _events(self, sched: TargetScheduler, gen) -> AsyncIterator[Event]:
        """The request's events until it finishes; on timeout, error or a vanished client the sequence is aborted."""
        queue = sched.submit(gen)
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
