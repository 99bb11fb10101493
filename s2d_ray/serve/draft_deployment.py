"""The ONE sorted-draft deployment every target shares: concurrent propose calls from all targets merge into one
batched draft forward (`@serve.batch`); KV per sequence id, checked against the token prefix of every call."""

from __future__ import annotations

import logging

from ray import serve

from ..build import apply_exits, build_draft, draft_base_source, load_profile, load_target, set_threads
from ..config import DraftConfig, EngineConfig, TargetConfig
from ..core.draft import SortedDraft, SortedDrafter
from ..core.stack import limit_rows
from ..core.types import DraftRequest, Proposal
from ..dtypes import resolve_dtype
from .app_config import AppConfig
from .replica import (
    Counted, IdleSequences, ModelThread, chunks, recomputed_tokens, replica_id, split_like,
    target_window,
)

logger = logging.getLogger(__name__)


def load_shared_draft(cfg: AppConfig) -> SortedDraft:
    """Load the draft's base model and the draft on top of it (exits/thresholds from cfg.draft and cfg.spec)."""
    base_source = draft_base_source(cfg.draft.source)
    ecfg = EngineConfig(
        target=TargetConfig(name=base_source, dtype=resolve_dtype(cfg.draft.dtype, cfg.draft.device)),
        draft=DraftConfig(source=cfg.draft.source, exit_layers=cfg.draft.exit_layers,
                          thresholds=cfg.draft.thresholds, stop_confidence=cfg.draft.stop_confidence),
        spec=cfg.spec, cache_dir=cfg.cache_dir, trust_remote_code=cfg.trust_remote_code,
    )
    base = load_target(ecfg)
    return build_draft(ecfg, base, load_profile(ecfg))


def per_target_drafters(cfg: AppConfig, draft: SortedDraft) -> dict[str, SortedDrafter]:
    """Targets whose calibration profile sets other exits/thresholds get a drafter with them (same weights, own KV);
    targets with equal settings share one, and those with the draft's own settings share the default."""
    out: dict[str, SortedDrafter] = {}
    by_settings: dict[tuple, SortedDrafter] = {}
    default = (tuple(draft.spec.exit_layers), tuple(draft.spec.thresholds))
    for t in cfg.targets:
        ecfg = cfg.engine_config(t.name)
        tuned = apply_exits(draft, ecfg, load_profile(ecfg))  # without a profile: the draft's own settings
        key = (tuple(tuned.spec.exit_layers), tuple(tuned.spec.thresholds))
        if key != default:
            out[t.name] = by_settings.setdefault(key, SortedDrafter(tuned, cfg.draft.stop_confidence))
    return out


@serve.deployment(name="draft")
class DraftDeployment:
    def __init__(self, cfg: AppConfig) -> None:
        set_threads(cfg.num_threads)
        self.thread = ModelThread(cfg.num_threads)
        draft = load_shared_draft(cfg)
        self.default = SortedDrafter(draft, cfg.draft.stop_confidence)
        self.by_target = per_target_drafters(cfg, draft)
        # Each distinct drafter once (targets with equal settings share one); fixed for the replica's lifetime.
        self.drafters = list({id(d): d for d in [self.default, *self.by_target.values()]}.values())
        self.max_rows = cfg.draft.max_live_sequences
        max_slots = max(target_window(cfg, t.name) for t in cfg.targets)
        for d in self.drafters:  # memory per drafter <= max_rows x max_slots (docs/SERVING.md)
            limit_rows(d, self.max_rows, max_slots)
        self.recomputed = 0  # tokens recomputed because this replica did not hold the prefix (all calls)
        self.replica = replica_id()
        self.idle = IdleSequences(cfg.limits.seq_idle_ttl_s)
        self.propose.set_max_batch_size(cfg.draft.max_batch_size)
        self.propose.set_batch_wait_timeout_s(cfg.draft.batch_wait_timeout_s)
        self.num_calls = 0  # propose calls received (one per target round)
        self.num_forwards = 0  # batched drafting runs
        self.num_shared_forwards = 0  # runs that drafted for more than one target at once
        logger.info("draft %s ready: exits=%s thresholds=%s, per-target profiles=%s", cfg.draft.source,
                    draft.spec.exit_layers, draft.spec.thresholds, sorted(self.by_target))

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.002)
    async def propose(self, targets: list[str], batches: list[list[DraftRequest]], seen: list[list[int]],
                      affinity: list[str | None]) -> list[Counted]:
        """One call per (target, round); calls that arrive together are drafted in one forward per profile.

        seen: per request, how many leading tokens an earlier round already drafted over (what this replica should
        hold); affinity: the caller's routing key (read by the request router, not here). Each call gets its
        proposals and the tokens this replica recomputed for it."""
        return await self.thread.run(self._propose_sync, targets, batches, seen)

    def _propose_sync(self, targets: list[str], batches: list[list[DraftRequest]],
                      seen: list[list[int]]) -> list[Counted]:
        self.num_calls += len(batches)
        results: list[Counted | None] = [None] * len(batches)
        for drafter in self.drafters:
            idx = [i for i, t in enumerate(targets) if self.by_target.get(t, self.default) is drafter]
            if not idx:
                continue
            group = [batches[i] for i in idx]
            flat = [r for b in group for r in b]
            self.idle.touch([r.seq_id for r in flat])
            recomputed = split_like(recomputed_tokens(drafter.table, flat, [n for i in idx for n in seen[i]]), group)
            self.num_forwards += 1
            self.num_shared_forwards += len({targets[i] for i in idx}) > 1
            proposals = [p for part in chunks(flat, self.max_rows) for p in drafter.propose(part)]
            for i, props, counts in zip(idx, split_like(proposals, group), recomputed):
                self.recomputed += sum(counts)
                results[i] = Counted(props, sum(counts), self.replica)
        return results  # type: ignore[return-value]

    async def release(self, seq_id: str, affinity: str | None = None) -> None:
        await self.thread.run(self._release_sync, [seq_id])

    def _release_sync(self, seq_ids: list[str]) -> None:
        for s in seq_ids:
            self.idle.forget(s)
            for d in self.drafters:
                d.release(s)

    async def stats(self) -> dict:
        return {"replica": self.replica, "num_active": sum(d.num_active for d in self.drafters),
                "num_calls": self.num_calls, "num_forwards": self.num_forwards,
                "num_shared_forwards": self.num_shared_forwards, "recomputed_tokens": self.recomputed,
                "num_evicted": sum(d.table.num_evicted for d in self.drafters), "max_live_sequences": self.max_rows,
                "cache_bytes": sum(d.cache.nbytes() + d.hidden.nbytes() for d in self.drafters)}

    async def check_health(self) -> None:
        """Healthy when the model thread answers; also drops KV of sequences idle past the TTL."""
        expired = self.idle.expired()
        if expired:
            logger.warning("dropping draft state of %d idle sequences", len(expired))
        await self.thread.run(self._release_sync, expired)
