"""The ONE sorted-draft deployment every target shares: concurrent propose calls from all targets merge into one
batched draft forward (`draft_batching.MergeQueue`, which holds a batch open for another target's round only when
that round is due within a share of one forward); KV per sequence id, checked against the token prefix of every
call."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from ray import serve

from ..build import apply_exits, build_draft, build_drafter, draft_base_source, load_profile, load_target, set_threads
from ..config import DraftConfig, EngineConfig, TargetConfig
from ..core.draft import SortedDraft, SortedDrafter
from ..core.rows import limit_rows
from ..core.types import DraftRequest
from ..hardware import resolve_dtype
from ..gc_pauses import gc_pauses
from .app_config import AppConfig
from .draft_autoscale import BUSY_METRIC
from .draft_batching import DraftCapacity, MergeQueue
from .replica import (
    Counted, IdleSequences, InProcessHandle, chunks, device_report, process_model_thread, recomputed_tokens,
    replica_id, return_freed_memory, split_like, target_window, to_host,
)

logger = logging.getLogger(__name__)


def load_shared_draft(cfg: AppConfig) -> SortedDraft:
    """Load the draft's base model and the draft on top of it (exits/thresholds from cfg.draft and cfg.spec)."""
    ecfg = draft_engine_config(cfg)
    base = load_target(ecfg)
    return build_draft(ecfg, base, load_profile(ecfg), base_model=cfg.draft.base_model)


def draft_engine_config(cfg: AppConfig) -> EngineConfig:
    """The engine settings the shared draft is built with: its base model as the `target`, the app's threads,
    kernels, CUDA graphs and prefix cache (draft KV depends on tokens alone: every target's rows share it)."""
    base_source = draft_base_source(cfg.draft.source, cfg.draft.base_model)
    return EngineConfig(
        target=TargetConfig(name=base_source, dtype=resolve_dtype(cfg.draft.dtype, cfg.draft.device)),
        draft=DraftConfig(source=cfg.draft.source, exit_layers=cfg.draft.exit_layers,
                          thresholds=cfg.draft.thresholds, stop_confidence=cfg.draft.stop_confidence),
        spec=cfg.spec, cache_dir=cfg.cache_dir, trust_remote_code=cfg.trust_remote_code,
        num_threads=cfg.num_threads, wide_threads=cfg.wide_threads, adaptive_threads=cfg.adaptive_threads,
        linear_kernel=cfg.linear_kernel, kernel_times=cfg.kernel_times, prefix_cache=cfg.prefix_cache,
    )


def per_target_drafters(cfg: AppConfig, draft: SortedDraft) -> tuple[dict[str, SortedDrafter], dict[str, tuple]]:
    """Targets whose calibration profile sets other exit LAYERS get a drafter with them (same weights, own KV);
    targets with equal layers share one. Thresholds travel per row (returned per target), so profiles that differ
    only in thresholds never force separate forwards."""
    out: dict[str, SortedDrafter] = {}
    thresholds: dict[str, tuple] = {}
    by_layers: dict[tuple, SortedDrafter] = {}
    for t in cfg.targets:
        ecfg = cfg.engine_config(t.name)
        tuned = apply_exits(draft, ecfg, load_profile(ecfg))  # without a profile: the draft's own settings
        layers = tuple(tuned.spec.exit_layers)
        if layers != tuple(draft.spec.exit_layers):
            if layers not in by_layers:
                by_layers[layers] = build_drafter(tuned, draft_engine_config(cfg))
            out[t.name] = by_layers[layers]
        own = out[t.name].thresholds if t.name in out else draft.spec.thresholds
        if tuple(tuned.spec.thresholds) != tuple(own):
            thresholds[t.name] = tuple(tuned.spec.thresholds)
    return out, thresholds


def propose_rows(drafter: SortedDrafter, rows: list[DraftRequest], max_rows: int) -> list:
    """The proposals of `rows` in forwards of at most `max_rows`, every q on the CPU: the router holds no GPU, so
    what leaves the draft deployment must be device-neutral (docs/SERVING.md)."""
    return to_host([p for part in chunks(rows, max_rows) for p in drafter.propose(part)])


@serve.deployment(name="draft")
class DraftDeployment:
    def __init__(self, cfg: AppConfig) -> None:
        gc_pauses()  # this process's collections, loading included
        set_threads(cfg.num_threads)
        self.thread = process_model_thread(cfg.num_threads)  # the router's, with draft.placement: router
        draft = load_shared_draft(cfg)
        self.default = build_drafter(draft, draft_engine_config(cfg))
        self.by_target, self.thresholds = per_target_drafters(cfg, draft)
        # Each distinct drafter once (targets with equal settings share one); fixed for the replica's lifetime.
        self.drafters = list({id(d): d for d in [self.default, *self.by_target.values()]}.values())
        self.max_rows = cfg.draft.max_live_sequences
        max_slots = max(target_window(cfg, t.name) for t in cfg.targets)
        for d in self.drafters:  # memory per drafter <= max_rows x max_slots (docs/SERVING.md)
            limit_rows(d, self.max_rows, max_slots)
        self.recomputed = 0  # tokens recomputed because this replica did not hold the prefix (all calls)
        self.replica = replica_id()
        self.idle = IdleSequences(cfg.limits.seq_idle_ttl_s)
        # The configured wait is the cap of an adaptive window (0 unless another caller's round is due soon).
        self.capacity = DraftCapacity(cfg.draft.batch_wait_timeout_s, cfg.draft.batch_wait_fraction)
        self.queue = MergeQueue(self.capacity, self._propose_batch, cfg.draft.max_batch_size)
        returned = return_freed_memory()  # the base's layers past the draft's, freed once it was built
        logger.info("draft %s ready: exits=%s thresholds=%s, per-target exits=%s, per-target thresholds=%s; %.0f MiB "
                    "freed while loading returned", cfg.draft.source, draft.spec.exit_layers, draft.spec.thresholds,
                    sorted(self.by_target), sorted(self.thresholds), returned / 2**20)

    async def propose(self, target: str, batch: list[DraftRequest], seen: list[int],
                      affinity: str | None = None) -> Counted:
        """One call per (target, round) of one router: queued for the next batch, which may wait for other callers.

        seen: per request, how many leading tokens an earlier round already drafted over (what this replica should
        hold); affinity: the caller's routing key (also read by the request router). A caller is a (target,
        affinity) stream: its rounds come one after another, so the queue predicts its next call. The call gets its
        proposals and the tokens this replica recomputed for it."""
        return await self.queue.submit((target, affinity), (target, batch, seen, time.monotonic()))

    async def _propose_batch(self, calls: list[tuple[str, list[DraftRequest], list[int], float]]) -> list[Counted]:
        """Calls batched together are drafted in one forward per drafter (per set of exit layers)."""
        targets, batches, seen, arrivals = (list(x) for x in zip(*calls))
        return await self.thread.run(self._propose_sync, targets, batches, seen, arrivals)

    def _propose_sync(self, targets: list[str], batches: list[list[DraftRequest]], seen: list[list[int]],
                      arrivals: list[float]) -> list[Counted]:
        results: list[Counted | None] = [None] * len(batches)
        for drafter in self.drafters:
            idx = [i for i, t in enumerate(targets) if self.by_target.get(t, self.default) is drafter]
            if not idx:
                continue
            group = [self._stamped(targets[i], batches[i]) for i in idx]
            flat = [r for b in group for r in b]
            self.idle.touch([r.seq_id for r in flat])
            recomputed = split_like(recomputed_tokens(drafter.table, flat, [n for i in idx for n in seen[i]]), group)
            start, cpu = time.monotonic(), time.thread_time()
            proposals = propose_rows(drafter, flat, self.max_rows)
            end, cpu = time.monotonic(), time.thread_time() - cpu
            self.capacity.forward([arrivals[i] for i in idx], {targets[i] for i in idx}, len(flat), start, end)
            for i, props, counts in zip(idx, split_like(proposals, group), recomputed):
                self.recomputed += sum(counts)
                # seconds: arrival to answer here (the merge hold and the forward), so the caller sees transport;
                # cpu: the model thread's CPU time in the forward, below its wall time by what it waited for a core
                # or the GIL (in the router, its event loop's)
                results[i] = Counted(props, sum(counts), self.replica, end - arrivals[i], cpu)
        return results  # type: ignore[return-value]

    def propose_now(self, target: str, batch: list[DraftRequest], seen: list[int]) -> Counted:
        """`propose` for a caller already on this process's model thread (a router's round run there whole, when
        no other target's round could merge with it): the same forward and accounting, no queue and no hop."""
        return self._propose_sync([target], [batch], [seen], [time.monotonic()])[0]

    def _stamped(self, target: str, batch: list[DraftRequest]) -> list[DraftRequest]:
        """The target's profile thresholds on each of its rows (rows that already carry thresholds keep them)."""
        th = self.thresholds.get(target)
        return batch if th is None else [r if r.thresholds is not None else replace(r, thresholds=th) for r in batch]

    async def release(self, seq_id: str, affinity: str | None = None) -> None:
        await self.thread.run(self._release_sync, [seq_id])

    def release_now(self, seq_id: str) -> None:
        """`release` on the model thread (see propose_now)."""
        self._release_sync([seq_id])

    def _release_sync(self, seq_ids: list[str]) -> None:
        for s in seq_ids:
            self.idle.forget(s)
            for d in self.drafters:
                d.release(s)

    async def stats(self) -> dict:
        return {"replica": self.replica, "num_active": sum(d.num_active for d in self.drafters),
                **self.capacity.stats(), "recomputed_tokens": self.recomputed,
                "num_evicted": sum(d.table.num_evicted for d in self.drafters), "max_live_sequences": self.max_rows,
                "cache_bytes": sum(d.cache.nbytes() + d.hidden.nbytes() for d in self.drafters),
                **{key: sum(d.prefix_cache_stats().get(key, 0) for d in self.drafters)
                   for key in ("prefix_cache_queries", "prefix_cache_hits")},
                "kernels": self.default.stack.kernels(), **device_report(self.default.draft),
                "gc": gc_pauses().snapshot()}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Pushed to Serve's controller when the draft autoscales: `draft_autoscale.DraftBusyPolicy` reads it."""
        return {BUSY_METRIC: self.capacity.busy_fraction(time.monotonic())}

    async def check_health(self) -> None:
        """Healthy when the model thread answers; also drops KV of sequences idle past the TTL."""
        expired = self.idle.expired()
        if expired:
            logger.warning("dropping draft state of %d idle sequences", len(expired))
        await self.thread.run(self._release_sync, expired)


def draft_in_router(cfg: AppConfig) -> InProcessHandle:
    """The shared draft loaded in this (router) process: the deployment's class, without Serve around it."""
    return InProcessHandle(DraftDeployment.func_or_class(cfg))
