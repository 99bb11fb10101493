"""One deployment per target: batched verification of every concurrent round (`@serve.batch`), per-sequence KV with
the core's prefix check; the model lives in the replica (tp_size 1) or in a DeepSpeed AutoTP group of Ray actors."""

from __future__ import annotations

import asyncio
import logging
import time

import torch
from ray import serve

from ..build import build_verifier, load_target, set_threads
from ..core.rows import limit_rows
from ..core.target import TargetVerifier
from ..core.types import ScoreRequest
from ..gc_pauses import gc_pauses
from .app_config import AppConfig
from .lora import new_bank, register_adapter, score_by_adapters
from .lora_registry import CATCH_UP_TIMEOUT_S
from .replica import (
    Counted, IdleSequences, InProcessHandle, chunks, device_report, process_model_thread, release_all, replica_id,
    return_freed_memory, sized_rows, split_like, target_window,
)
from .tp import TPGroup

logger = logging.getLogger(__name__)


class LocalTarget:
    """The whole model in this process; forwards run on the process's one model thread (shared with the draft when
    both are placed in the router)."""

    def __init__(self, verifier: TargetVerifier, num_threads: int | None) -> None:
        self.verifier = verifier
        self.thread = process_model_thread(num_threads)
        self.cpu_s = 0.0  # the model thread's CPU seconds in this target's forwards (not the draft's beside it)

    async def score(self, requests: list[ScoreRequest], expected: list[int]) -> tuple[list[torch.Tensor], list[int]]:
        """Logits and tokens recomputed per request (see replica.recomputed_tokens)."""
        out, cpu = await self.thread.run_timed(score_by_adapters, self.verifier, requests, expected)
        self.cpu_s += cpu
        return out

    def score_now(self, requests: list[ScoreRequest], expected: list[int]) -> tuple[list[torch.Tensor], list[int]]:
        """`score` for a caller already on the model thread (a router's round run there whole)."""
        cpu = time.thread_time()
        try:
            return score_by_adapters(self.verifier, requests, expected)
        finally:
            self.cpu_s += time.thread_time() - cpu

    async def release(self, seq_ids: list[str]) -> None:
        await self.thread.run(release_all, self.verifier, seq_ids)

    async def num_active(self) -> int:
        return self.verifier.num_active

    async def check(self) -> None:
        await self.thread.run(lambda: None)

    def describe(self) -> dict:
        table = self.verifier.table
        cache = self.verifier.cache
        return {"tp_size": 1, "num_evicted": table.num_evicted, "num_forked_tokens": table.num_forked_tokens,
                "cache_bytes": cache.nbytes(), "num_passes": cache.num_passes,
                "num_gathered_passes": cache.num_gathered, "kernels": self.verifier.stack.kernels(),
                **self.verifier.prefix_cache_stats(),
                **device_report(self.verifier.model)}

    def close(self) -> None:
        """Nothing to stop: the model thread is the process's (it ends with the process)."""


class RuntimeAdapters:
    """A starting target replica's catch-up with the app's runtime LoRA loads and unloads (serve/lora_registry.py):
    once, before its first forward, it registers the adapters loaded since the config and forgets configured ones
    unloaded, so a replica started after a load (a scale-up, a restart) serves it like the others."""

    def __init__(self, registry, base: str) -> None:
        self.registry, self.base = registry, base
        self.done = registry is None
        self._lock = asyncio.Lock()

    async def apply(self, replica: TargetDeployment) -> None:
        if self.done:
            return
        async with self._lock:  # concurrent first calls wait for the one catch-up
            if self.done:
                return
            try:
                changes = await asyncio.wait_for(self.registry.for_base.remote(self.base), CATCH_UP_TIMEOUT_S)
            except Exception:  # the registry is being replaced: serve what is registered, try again next call
                logger.warning("target %s: adapter registry unreachable; runtime adapters not registered yet",
                               self.base, exc_info=True)
                return
            for name, where in changes["load"].items():
                loaded = await replica.load_adapter(name, where)
                if "error" in loaded:  # this replica cannot read it (a path not on its node): its rows fail
                    logger.error("target %s: runtime adapter %s not registered: %s", self.base, name,
                                 loaded["error"])
            for name in changes["unload"]:
                await replica.unload_adapter(name)
            logger.info("target %s: runtime adapters registered %s, unloaded %s", self.base,
                        sorted(changes["load"]), changes["unload"])
            self.done = True


@serve.deployment
class TargetDeployment:
    def __init__(self, cfg: AppConfig, name: str, lora_registry=None) -> None:
        gc_pauses()  # this process's collections, loading included
        spec, ecfg = cfg.target(name), cfg.engine_config(name)
        set_threads(cfg.num_threads)
        self.name = name
        max_slots = target_window(cfg, name)
        self.lora = None
        if spec.tp_size > 1:
            self.backend = TPGroup(ecfg, spec, cfg.limits.score_timeout_s, max_slots)
            self.max_rows = self.backend.max_rows
        else:
            model = load_target(ecfg).model
            self.lora = new_bank(spec)  # LoRA adapters verified per row (serve/lora.py), None without `lora:`
            verifier = build_verifier(model, ecfg, lora=self.lora)
            for adapter, where in (spec.lora.adapters.items() if spec.lora else ()):
                loaded = register_adapter(self.lora, adapter, where)
                if "error" in loaded:
                    raise ValueError(f"target {name}: {loaded['error']}")
            self.max_rows = sized_rows(spec, model, max_slots)
            limit_rows(verifier, self.max_rows, max_slots)  # KV <= max_rows x max_slots (docs/SERVING.md)
            self.backend = LocalTarget(verifier, cfg.num_threads)
        # adapters loaded or unloaded at run time before this replica started: applied before its first forward
        self.runtime_adapters = RuntimeAdapters(lora_registry, name) if spec.lora is not None else None
        self.recomputed = 0  # tokens recomputed because this replica did not hold the prefix (all calls)
        self.replica = replica_id()
        self.idle = IdleSequences(cfg.limits.seq_idle_ttl_s)
        self.score.set_max_batch_size(spec.max_batch_size)
        self.score.set_batch_wait_timeout_s(spec.batch_wait_timeout_s)
        self.num_calls = 0
        self.num_forwards = 0
        returned = return_freed_memory()
        logger.info("target %s ready (tp_size=%d); %.0f MiB freed while loading returned", name, spec.tp_size,
                    returned / 2**20)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.002)
    async def score(self, batches: list[list[ScoreRequest]], seen: list[list[int]],
                    affinity: list[str | None]) -> list[Counted]:
        """One call per router round; concurrent rounds (several routers) share one forward (split past
        max_live_sequences). seen: per request, tokens an earlier round verified; affinity: the routing key. Each
        call gets its logits and the tokens this replica recomputed for it."""
        if self.runtime_adapters is not None:
            await self.runtime_adapters.apply(self)
        logits: list[torch.Tensor] = []
        recomputed: list[int] = []
        start, cpu = time.perf_counter(), self.backend.cpu_s
        for part, part_expected in self._parts(batches, seen):
            out, counts = await self.backend.score(part, part_expected)
            logits += out
            recomputed += counts
        return self._answers(batches, logits, recomputed, time.perf_counter() - start, self.backend.cpu_s - cpu)

    def score_now(self, batch: list[ScoreRequest], seen: list[int]) -> Counted:
        """`score` for one caller already on this process's model thread (a router's round run there whole): the
        same forwards and accounting, without the batch queue or a hop. Only a target whose model is in this
        process has it (`inline`)."""
        logits: list[torch.Tensor] = []
        recomputed: list[int] = []
        start, cpu = time.perf_counter(), self.backend.cpu_s
        for part, part_expected in self._parts([batch], [seen]):
            out, counts = self.backend.score_now(part, part_expected)
            logits += out
            recomputed += counts
        return self._answers([batch], logits, recomputed, time.perf_counter() - start, self.backend.cpu_s - cpu)[0]

    @property
    def inline(self) -> bool:
        """Whether `score_now` can run: the whole model is in this process (not a TP group)."""
        return isinstance(self.backend, LocalTarget)

    def _parts(self, batches: list[list[ScoreRequest]], seen: list[list[int]]) -> list[tuple[list, list[int]]]:
        """The calls' requests and expected counts in forwards of at most max_live_sequences rows (counted)."""
        flat = [r for b in batches for r in b]
        self.idle.touch([r.seq_id for r in flat])
        self.num_calls += len(batches)
        parts = list(zip(chunks(flat, self.max_rows), chunks([n for s in seen for n in s], self.max_rows)))
        self.num_forwards += len(parts)
        return parts

    def _answers(self, batches: list[list[ScoreRequest]], logits: list[torch.Tensor], recomputed: list[int],
                 seconds: float, cpu: float) -> list[Counted]:
        self.recomputed += sum(recomputed)
        return [Counted(out, sum(counts), self.replica, seconds, cpu)
                for out, counts in zip(split_like(logits, batches), split_like(recomputed, batches))]

    async def release(self, seq_id: str, affinity: str | None = None) -> None:
        self.idle.forget(seq_id)
        await self.backend.release([seq_id])

    def release_now(self, seq_id: str) -> None:
        """`release` on the model thread (see score_now)."""
        self.idle.forget(seq_id)
        release_all(self.backend.verifier, [seq_id])

    async def load_adapter(self, name: str, where: str, affinity: str | None = None) -> dict:
        """Register a LoRA adapter on this replica (between forwards, on the model thread): {"loaded"} or
        {"error"}."""
        if isinstance(self.backend, TPGroup):  # every rank registers its cut of it (serve/tp.py)
            return {**await self.backend.load_adapter(name, where), "replica": self.replica}
        if self.lora is None:
            return {**register_adapter(None, name, where), "replica": self.replica}
        return {**await self.backend.thread.run(register_adapter, self.lora, name, where), "replica": self.replica}

    async def unload_adapter(self, name: str, affinity: str | None = None) -> dict:
        """Forget an adapter on this replica: {"unloaded": whether it was registered}."""
        if isinstance(self.backend, TPGroup):
            gone = await self.backend.unload_adapter(name)
        else:
            gone = self.lora is not None and await self.backend.thread.run(self.lora.unregister, name)
        return {"unloaded": gone, "replica": self.replica}

    async def stats(self, affinity: str | None = None) -> dict:
        """affinity: read by the request router only (/health asks each replica with a key pinned to it)."""
        return {"replica": self.replica, "num_active": await self.backend.num_active(), "num_calls": self.num_calls,
                "num_forwards": self.num_forwards, "recomputed_tokens": self.recomputed,
                "max_live_sequences": self.max_rows, **self.backend.describe(), "gc": gc_pauses().snapshot(),
                **({"lora": self.lora.stats()} if self.lora is not None else {})}

    async def check_health(self) -> None:
        """Raises when the model thread or any TP rank stops answering; drops state of long-idle sequences."""
        if self.runtime_adapters is not None:
            await self.runtime_adapters.apply(self)
        await self.backend.check()
        expired = self.idle.expired()
        if expired:
            logger.warning("target %s: dropping state of %d idle sequences", self.name, len(expired))
            for s in expired:
                self.idle.forget(s)
            await self.backend.release(expired)

    def __del__(self) -> None:
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.close()


def target_in_router(cfg: AppConfig, name: str) -> InProcessHandle:
    """A target loaded in this (router) process (`placement: router`): the deployment's class without Serve around
    it; its `@serve.batch` runs on the router's event loop and its forwards on the process's model thread."""
    return InProcessHandle(TargetDeployment.func_or_class(cfg, name))
