"""The ingress: OpenAI-compatible HTTP API, the Python handle API, /health and /metrics.

It holds tokenizers only; per target it owns one TargetScheduler (one SpecEngine + one decode loop) whose drafter is
the shared draft deployment and whose verifier is the target deployment. What a request goes through once admitted is
serve/request_flow.py's, a streamed response's events serve/sse.py's, and the bounded stats calls to the deployments
serve/router_stats.py's.
"""

# No `from __future__ import annotations` here: Serve's ingress re-creates the route methods and FastAPI must see
# real annotation objects (a string "Request" would be taken for a query parameter).
import asyncio
import contextlib
import logging
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
from ..gc_pauses import gc_pauses
from ..models import check_same_vocabulary
from .admission import PreparedGroup, Preparer
from .affinity import Affinity
from .app_config import AppConfig
from .choices import first_items, gather_all
from .clients import DraftClient, TargetClient
from .detokenize import cleans_up_spaces
from .draft_deadline import DeadlinePolicy, DraftDeadline
from .http_api import (
    ApiError, api_error, body_schema, error_response, parse_body, read_body, validation_error,
)
from .keepalive import settled_within
from .loaders import load_tokenizer
from .lora import RouterAdapters, adapter_residency, in_use, load_adapter, unload_adapter
from .lora_config import LoadLoraRequest, UnloadLoraRequest
from .lora_registry import AdapterSync
from .metrics import ServeMetrics, prefix_cache_totals
from .metrics_hub import HubPusher
from .openai_protocol import (
    ChatCompletionRequest, ChoiceView, CompletionRequest, GenerateChunk, GenerateRequest, GenerateResponse,
    ResponseIds, full_response,
)
from ..token_bytes import token_bytes_fn
from .prepare import ModelInfo, encode, to_generation
from .replica import InProcessHandle, device_report, process_model_thread, replica_id, target_window
from .request_flow import RequestFlow
from .request_limits import check_request_limits, heavy_request
from .round_timing import CallTimes
from .router_stats import STATS_TIMEOUT_S, call_stats, recomputed, replica_stats
from .health import ReadinessProbe, serve_status_reader, with_status
from .scheduler import TargetScheduler
from .sse import EventStream
from .tenants import TenantKeys, end_user_scope

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


FIRST_WAIT_S = 1.0  # a stream's status waits this long for its first tokens, then it starts with keep-alives


# Serve serializes the class when it is decorated: everything its methods use must be defined above this line.
@serve.deployment(name="router")
@serve.ingress(app)
class Router:
    def __init__(self, cfg: AppConfig, draft, targets: dict, metrics_hub=None, lora_registry=None) -> None:
        gc_pauses()  # this process's collections, loading included
        set_threads(1)
        self.cfg = cfg
        self.tenants = TenantKeys.from_config(cfg.api_key, cfg.tenants)  # who may call, and their cache scopes
        self.metrics = ServeMetrics()
        self.metrics_hub = metrics_hub  # metrics_hub.py: /metrics over every router replica
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
        self.pusher = HubPusher(metrics_hub, self.replica, self.metrics.registry)
        self.readiness = ReadinessProbe(
            serve_status_reader(serve.get_replica_context().app_name),
            {t.name: None if t.placement == "router" else f"target-{t.name}" for t in cfg.targets},  # build_app's names
            "draft" if cfg.draft_deployment else None)
        self.models = {t.name: self._model_info(t.name) for t in cfg.targets}
        # LoRA adapters: model names decoded by their base's engine; runtime loads shared through the registry
        self.adapters = RouterAdapters(cfg, lora_registry, self._forget_adapter)
        self.adapter_sync = AdapterSync(lora_registry, self.replica,
                                        lambda loaded, removed: self.adapters.apply(self.models, loaded, removed),
                                        lambda: in_use(self.schedulers.values(), self.adapters))
        if cfg.uses_draft:
            base = load_tokenizer(draft_base_source(cfg.draft.source, cfg.draft.base_model), cfg.cache_dir,
                                  cfg.trust_remote_code)
            for info in self.models.values():
                check_same_vocabulary(base, info.tokenizer, f"draft {cfg.draft.source}", f"target {info.name}")
        self.schedulers = {name: self._scheduler(name) for name in self.models}
        self.models.update({a: replace(self.models[base], name=a) for a, base in self.adapters.base_of.items()})
        self.preparer = Preparer(cfg.limits.prepare_share)  # tokenizing and grammar compiles, off the event loop
        self.flow = RequestFlow(cfg, self.models, self.schedulers, self.adapters, self.tenants, self.preparer,
                                self.metrics, self.pusher)  # one request's life (request_flow.py)
        self.sse = EventStream(self.metrics, cfg.router.keepalive_s)  # streamed responses (sse.py)
        logger.info("router: targets %s (sequences admitted at once %s), draft %s, tenants %s (isolation %s)",
                    sorted(self.models), {n: s.max_running for n, s in self.schedulers.items()},
                    cfg.draft.source if cfg.uses_draft else None, self.tenants.names or "none: open",
                    cfg.tenants.isolation)

    def _forget_adapter(self, name: str) -> None:
        """An adapter was unloaded: no replica holds it now, so a later load of the name starts afresh."""
        for affinity in self.affinities:
            if affinity.adapters is not None:
                affinity.adapters.forget(name)

    async def _known_model(self, model: str) -> None:
        """Before a request: this router's copy of the runtime adapters is fresh enough for `model`
        (serve/lora_registry.py)."""
        if self.adapters.registry is not None and model not in self.adapters.targets:
            await self.adapter_sync.ensure(model, model in self.models)

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
                                 plain_steps=spec.plain_steps if spec.tp_size == 1 else 1,
                                 detokenize_whole=cleans_up_spaces(info.tokenizer))
        # Rounds run whole on the process's model thread while no other target of this router has work (the
        # draft and target must both be in this process; `router.whole_rounds`).
        thread = process_model_thread(cfg.num_threads) if cfg.router.whole_rounds and self._in_process else None
        return TargetScheduler(name, engine, cfg.max_sequences(name), cfg.limits.max_queued_requests, self.metrics,
                               thread, busy_elsewhere=lambda: self._busy_besides(name))

    def _target_client(self, name: str) -> TargetClient:
        """The engine's verifier for one target: its calls' overhead observed in s2d:call_overhead_seconds."""
        affinity = Affinity(self.affinity, f"target-{name}", self.metrics.recomputed_tokens, self._routing)
        affinity.adapters = adapter_residency(self.cfg, name)  # LoRA rows prefer replicas holding their adapter
        self.affinities.append(affinity)
        times = CallTimes(observe=self.metrics.call_overhead.labels(name, "target").observe)
        return TargetClient(self.target_handles[name], name, self.cfg.limits.score_timeout_s, affinity, times,
                            failover_s=self.cfg.target(name).failover_s,
                            on_failover=self.metrics.target_failovers.labels(name).inc)

    def _draft_client(self, name: str) -> DraftClient:
        """One target's client of the shared draft: its fallback rounds counted, its calls' overhead observed."""
        affinity = Affinity(self.affinity, "draft", self.metrics.recomputed_tokens, self._routing)
        self.affinities.append(affinity)
        times = CallTimes(observe=self.metrics.call_overhead.labels(name, "draft").observe)
        d = self.cfg.draft
        deadline = DraftDeadline(DeadlinePolicy(d.call_timeout_s, d.retry_after_s, d.retry_max_s,
                                                d.call_timeout_margin, d.call_timeout_floor_s))
        return DraftClient(self.draft_handle, name, d.call_timeout_s, d.retry_after_s, deadline=deadline,
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
        await self._known_model(req.model)
        return await self.flow.generate(req)

    async def generate_stream(self, request: GenerateRequest | dict) -> AsyncIterator[GenerateChunk]:
        """`handle.options(stream=True).generate_stream.remote(...)`: one chunk per round."""
        req = GenerateRequest.model_validate(request)
        await self._known_model(req.model)
        async with contextlib.aclosing(self.flow.run(req)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def stats(self) -> dict:
        """Router queues plus each deployment's live-sequence count (tests check KV is freed after disconnects)."""
        out: dict = {"router": self.replica, "targets": {}, **device_report(None)}  # rounds' sampling: CPU
        if self.adapters.registry is not None:
            await self.adapter_sync.refresh()  # loads and unloads made through other routers
        out["adapters"] = sorted(self.adapters.base_of)  # the LoRA adapter names this router serves now
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
        answers = await asyncio.gather(*(replica_stats(h) for h in handles[:len(names)]),
                                       *(call_stats(h) for h in handles[len(names):]))
        for name, reps in zip(names, answers):
            out["targets"][name]["deployment"] = reps[0]
            out["targets"][name]["prefix_cache"] = prefix_cache_totals(reps)
        out["draft"] = answers[-1] if self.cfg.uses_draft else None
        out["recomputed_tokens"] = recomputed(self.affinities)
        out["gc"] = gc_pauses().snapshot()  # this process's (placed models included)
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
        self.tenants.authenticate(request)
        if self.adapters.registry is not None:
            await self.adapter_sync.refresh()  # loads and unloads made through other routers
        return {"object": "list", "data": [
            {"id": m.name, "object": "model", "created": 0, "owned_by": "s2d-ray", "max_model_len": m.max_context,
             "parent": self.adapters.base_of.get(m.name)}
            for m in self.models.values()]}

    @app.post("/v1/load_lora_adapter", openapi_extra=body_schema(LoadLoraRequest))
    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's runtime adapter load (serve/lora.py)."""
        self.tenants.require_operator(request)  # an adapter changes what every tenant is served
        body = parse_body(await read_body(request, self.cfg.limits.max_body_bytes), LoadLoraRequest)
        return JSONResponse(await load_adapter(self, body))

    @app.post("/v1/unload_lora_adapter", openapi_extra=body_schema(UnloadLoraRequest))
    async def unload_lora_adapter(self, request: Request) -> Response:
        self.tenants.require_operator(request)  # an adapter changes what every tenant is served
        body = parse_body(await read_body(request, self.cfg.limits.max_body_bytes), UnloadLoraRequest)
        return JSONResponse(await unload_adapter(self, body, self.cfg.limits.request_timeout_s))

    @app.get("/health")
    async def health(self) -> dict:
        """Liveness: this router replica answers (local: no call to any deployment). Models: /health/ready."""
        return {"status": "ok"}

    @app.get("/health/ready")
    async def ready(self) -> JSONResponse:
        """Readiness of every model (health.py); 200 while at least one model is ready, so one target reloading
        does not take the others out of a load balancer."""
        ready = await self.readiness.check()
        return JSONResponse(ready.body(), status_code=200 if any(ready.models.values()) else 503)

    @app.get("/health/ready/{model}")
    async def model_ready(self, model: str) -> JSONResponse:
        """One model's readiness: 200 or 503 (a load balancer pool per model probes this)."""
        if model not in self.models:
            raise ApiError(404, f"model {model!r} is not served here", "model_not_found", "model")
        ready = await self.readiness.check()
        return JSONResponse({"model": model, "ready": ready.models[model]},
                            status_code=200 if ready.models[model] else 503)

    @app.get("/stats")
    async def stats_view(self, request: Request) -> JSONResponse:
        """Every deployment's state (replica ids, nodes, processes, caches of every tenant, failures): an operator's
        key (tenants.py). "degraded": the draft fails (rounds go target-only); "failing": a target does."""
        self.tenants.require_operator(request)
        try:  # each deployment's call is bounded at STATS_TIMEOUT_S and they run at once; this bounds the rest
            stats = await asyncio.wait_for(self.stats(), STATS_TIMEOUT_S + 5.0)
        except Exception as exc:
            return JSONResponse({"status": "failing", "error": f"{type(exc).__name__}: {exc}"})
        return JSONResponse(with_status(stats))

    async def check_health(self) -> None:
        """Serve's periodic check: the draft and targets placed here answer on their model threads, and their idle
        state is dropped."""
        for handle in self._in_process:
            await handle.check_health.remote()

    @app.get("/metrics")
    async def prometheus(self, request: Request) -> Response:
        """Prometheus text of the whole app (every router replica, through the metrics hub): every tenant's figures,
        so an operator's key (open when the app has no keys)."""
        self.tenants.require_operator(request)
        if self.metrics_hub is None:  # a router built outside build_app: this replica's own counters
            return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)
        draft = await call_stats(self.draft_handle) if self.cfg.uses_draft else None
        # the prefix cache counters live in the target replicas
        prefix = {name: await replica_stats(self.target_handles[name]) for name in self.schedulers}
        await self.pusher.push()  # this replica's counters as of now
        body = await self.metrics_hub.render.remote(draft, prefix)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def _openai(self, request: Request, kind: type[CompletionRequest | ChatCompletionRequest],
                      chat: bool) -> Response:
        model = "unknown"
        try:
            tenant = self.tenants.authenticate(request)
            oreq = parse_body(await read_body(request, self.cfg.limits.max_body_bytes), kind)
            check_request_limits(oreq, self.cfg.limits)  # before the fan-out copies it per choice
            try:
                greqs = oreq.to_generate(self.cfg.limits.max_choices)  # one per choice
            except ValidationError as exc:
                raise validation_error(exc) from None
            scoped = {"tenant": tenant.name, "cache_salt": oreq.cache_salt,
                      "suffix_scope": end_user_scope(oreq.user, oreq.safety_identifier)}
            greqs = [g.model_copy(update=scoped) for g in greqs]
            await self._known_model(oreq.model)
            info = self.flow.info(oreq.model)
            model = info.name
            ids = ResponseIds(chat)
            views = [self._view(ids, i, g, oreq, info) for i, g in enumerate(greqs)]
            group = PreparedGroup(self.preparer, to_generation, [(info, g, self.cfg.limits) for g in greqs],
                                  heavy=any(heavy_request(g) for g in greqs))
            if oreq.stream:
                streams = [self.flow.run(g, group, i) for i, g in enumerate(greqs)]
                # admission errors (404, 400, 429) still get an HTTP status; a queued stream starts with keep-alives
                pending = asyncio.ensure_future(first_items(streams))
                waiting = not await settled_within(pending, min(FIRST_WAIT_S, self.cfg.router.keepalive_s))
                sse = (self.sse.queued(pending, ids, model, views, streams, oreq.n) if waiting else
                       self.sse.stream(ids, model, views, pending.result(), streams, oreq.n))
                return StreamingResponse(sse, media_type="text/event-stream")
            resps = await gather_all([self.flow.generate(g, group, i) for i, g in enumerate(greqs)])
            return JSONResponse(full_response(ids, model, views, resps, oreq.n))
        except Exception as exc:
            err = api_error(exc)  # a 5xx's exception goes to the log with the id the client gets
            self.metrics.errors.labels(model, str(err.status)).inc()
            return error_response(err)


    @staticmethod
    def _view(ids: ResponseIds, index: int, greq: GenerateRequest, oreq, info: ModelInfo) -> ChoiceView:
        echo = None
        if getattr(oreq, "echo", False):
            # Token ids are checked (a 400) before they are decoded: the tokenizer fails on ids outside its vocabulary.
            echo = greq.prompt if greq.prompt is not None else info.tokenizer.decode(encode(info, greq))
        return ChoiceView(ids, index, lambda t: info.tokenizer.decode([t]), greq.logprobs is not None, echo,
                          oreq.return_token_ids, greq.tool_mode, token_bytes_fn(info.tokenizer))
