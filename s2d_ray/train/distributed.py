"""Data-parallel SoFT: one `Run` per worker, each on its slice of the global batch, gradients averaged by DDP
(`zero` 0) or DeepSpeed ZeRO (stage 1 or 2).

Every worker builds the same run (models, data, vocabulary, optimiser) from the same config, so batch `s` is the same
global batch as in one process; worker r trains on its r-th equal slice. Each worker's loss is its slice's sums over
the global batch's counts (times the world size, which the gradient average divides out), so the averaged gradient
is exactly the one-process gradient of the global batch and a step equals the one-process step up to summation order.

Checkpoints keep the one-process format (`checkpoint.pt`, torch AdamW's state; under ZeRO gathered from the
partitions), so a run moves between one process and N workers in either direction. Rank 0 writes them and hands each
to `report` (Ray Train persists it; ray_train.py). The KD cache is built by the workers together: before each step,
the missing chunks that the next `world` global batches need are split over the ranks.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..shm_buffers import unlink_when_mapped
from .data import Packed
from .soft import CKPT, Run, SoftConfig

logger = logging.getLogger(__name__)
ZERO_STAGES = (0, 1, 2)
# ZeRO-3 partitions the weights too and gathers a layer only inside DeepSpeed's forward hooks; validation and export
# read the whole draft outside them (and the head rows enter F.linear directly), so under DeepSpeed 0.19.8 they see
# empty partitions. Stage 2 already shards what dominates a draft's training memory (gradients, AdamW's moments).
ZERO3_REFUSED = ("--zero 3 is not supported: ZeRO-3 partitions the draft's weights, which validation and export "
                 "read whole outside DeepSpeed's forward hooks; use --zero 2 (gradients and AdamW state sharded)")
StepHook = Callable[[int, int], None]  # (rank, step about to run): e.g. progress, or a fault injected in a test
Reporter = Callable[[dict, "Path | None"], None]  # (metrics, checkpoint directory or None), called on every rank


@dataclass(frozen=True)
class World:
    """This worker's place: rank, world size, and how gradients are shared (0: DDP, 1 or 2: ZeRO stage)."""

    rank: int
    size: int
    zero: int = 0


class Trainables(nn.Module):
    """The draft's trained tensors (its layers; with --train-norm-head its norm and head rows) as one module whose
    forward is the SoFT loss: what DDP and DeepSpeed wrap. Parameters are the run's own (a module lists its own
    parameters before its submodules', so code that pairs them with the optimiser's state uses `Run.params`)."""

    def __init__(self, run: Run) -> None:
        super().__init__()
        self.layers = run.draft.layers
        if run.head_rows is not None:
            self.norm = run.draft.parts.norm
            self.head_rows = run.head_rows
        self._run = [run]  # a plain list: the run is not a submodule

    def forward(self, batch: Packed, shares: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
        loss, per_exit = self._run[0].loss_on(batch, shares)
        return loss, torch.tensor(per_exit, dtype=torch.float64)


def slice_rows(batch: Packed, lo: int, hi: int) -> Packed:
    """Rows lo..hi-1 of a batch."""
    return Packed(*(None if t is None else t[lo:hi] for t in (batch.ids, batch.labels, batch.positions, batch.doc,
                                                             batch.row)))


class DistributedRun(Run):
    """A SoFT run that is one rank of a data-parallel group (torch.distributed already initialised)."""

    def __init__(self, cfg: SoftConfig, world: World, report: Reporter | None = None,
                 step_hook: StepHook | None = None) -> None:
        if world.zero == 3:
            raise ValueError(ZERO3_REFUSED)
        if world.zero not in ZERO_STAGES:
            raise ValueError(f"--zero must be one of {ZERO_STAGES}, got {world.zero}")
        if cfg.batch_size % world.size:
            raise ValueError(f"--batch-size {cfg.batch_size} must be a multiple of --num-workers {world.size}")
        self.world, self.report, self.step_hook = world, report, step_hook
        super().__init__(cfg)
        self.module = Trainables(self)
        self.engine: nn.Module | None = None

    # -- start: weights and optimiser state first, then the wrapper that shares gradients -------------------------
    def start(self, checkpoint: Path | None = None) -> bool:
        """Resume from `checkpoint` (a one-process checkpoint file) if given, then wrap the trainables; True when
        resumed."""
        resumed = self.resume(checkpoint) if checkpoint is not None else False
        if self.world.zero == 0:
            unused = self.cfg.exits()[-1] < len(self.draft.layers)
            self.engine = nn.parallel.DistributedDataParallel(self.module, find_unused_parameters=unused)
            return resumed
        saved = self.opt.state_dict() if resumed else None
        self.engine = self._deepspeed()
        if saved is not None:
            self._load_zero_state(saved)
        return resumed

    def _deepspeed(self) -> nn.Module:
        import deepspeed

        micro = self.cfg.batch_size // self.world.size
        config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
                  "gradient_clipping": self.cfg.grad_clip, "zero_optimization": {"stage": self.world.zero},
                  "zero_allow_untested_optimizer": True, "steps_per_print": 2**31 - 1}
        engine, _, _, _ = deepspeed.initialize(model=self.module, optimizer=self.opt, lr_scheduler=self.sched,
                                               config=config)
        unlink_when_mapped(self.world.rank, dist.barrier)  # a restarted worker group leaves no /dev/shm file behind
        return engine

    def _load_zero_state(self, saved: dict) -> None:
        """Scatter a one-process AdamW state (parameter index -> moments, step) into ZeRO's partitions. ZeRO makes its
        state at the first step, so empty moments and the step count are made here first, then linked to each
        parameter's fragment and filled."""
        from deepspeed.utils import safe_set_full_optimizer_state

        zero = self.engine.optimizer
        step = torch.as_tensor(next(iter(saved["state"].values()))["step"], dtype=torch.float32)
        zero.optimizer.state.clear()  # the whole parameters' moments that resume() loaded: ZeRO keeps only its part
        for flat in zero.single_partition_of_fp32_groups:
            zero.optimizer.state[flat] = {"step": step.clone(), "exp_avg": torch.zeros_like(flat),
                                          "exp_avg_sq": torch.zeros_like(flat)}
        zero._lazy_init_hp_params_optimizer_state()
        for i, p in enumerate(self.params):  # the optimiser's order (a module lists its own parameters first)
            for key in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, saved["state"][i][key].to(p.dtype), key)

    def _zero_state(self) -> dict:
        """ZeRO's partitioned AdamW state gathered into torch AdamW's one-process layout (a collective)."""
        from deepspeed.utils import safe_get_full_optimizer_state

        zero = self.engine.optimizer
        step = zero.optimizer.state.get(zero.single_partition_of_fp32_groups[0], {}).get("step", 0)
        step = torch.as_tensor(step, dtype=torch.float32).clone()
        params = self.params
        state = {i: {"step": step.clone(), **{k: safe_get_full_optimizer_state(p, k).detach().cpu().to(p.dtype)
                                              for k in ("exp_avg", "exp_avg_sq")}}
                 for i, p in enumerate(params)}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(len(params)))}
                  for g in self.opt.param_groups]
        return {"state": state, "param_groups": groups}

    # -- the loop's steps ------------------------------------------------------------------------------------------
    def train_step(self, batch: Packed) -> list[float]:
        """This rank's slice of the global batch; gradients averaged over the ranks; returns the global per-exit
        losses (the same on every rank)."""
        if self.step_hook is not None:
            self.step_hook(self.world.rank, self.step)
        self._build_kd_ahead()
        per = len(batch.ids) // self.world.size
        local = slice_rows(batch, self.world.rank * per, (self.world.rank + 1) * per)
        loss, per_exit = self.engine(local, self._shares(batch, local))
        if self.world.zero == 0:
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
            self.opt.step()
            self.sched.step()
        else:
            self.engine.backward(loss)
            self.engine.step()
        per_exit = per_exit.to(self.device)  # NCCL reduces device tensors only
        dist.all_reduce(per_exit, op=dist.ReduceOp.SUM)
        return (per_exit / self.world.size).tolist()

    def _counts(self, batch: Packed) -> tuple[int, int]:
        """(labels the CE counts: in the draft's vocabulary; labelled positions: what KD averages over)."""
        labels = batch.labels[batch.labels != -100]
        if self.vocab.index is not None:
            labels = labels.to(self.vocab.index.device)
        return int((self.vocab.map_labels(labels) != -100).sum()), len(labels)

    def _shares(self, batch: Packed, local: Packed) -> tuple[float, float]:
        (ce_all, pos_all), (ce, pos) = self._counts(batch), self._counts(local)
        return self.world.size * ce / max(ce_all, 1), self.world.size * pos / max(pos_all, 1)

    def _build_kd_ahead(self) -> None:
        """The KD cache chunks that this and the next `world - 1` global batches need and that are missing, split
        over the ranks (every rank sees the same files: one node, or a shared --kd-cache). Mostly in the first
        epoch; later only the rows an epoch's last partial batch left out. No rank builds a chunk while another
        might build it too."""
        if not self.kd_caches:
            return
        steps = range(self.step, min(self.step + self.world.size, self.cfg.steps))
        rows = [r for s in steps for r in self.batch_at(s).row.tolist()]
        self.batch_at(self.step)  # back to this step's epoch (the look-ahead may cross into the next)
        dist.barrier()  # every rank lists the missing chunks before any builds one
        for cache in self.kd_caches:
            todo = cache.missing_for(rows)
            cache.build(cache.builder, progress=False, chunks=todo[self.world.rank :: self.world.size])
        dist.barrier()

    def validate(self) -> None:
        """Rank 0 measures (the weights are whole and equal on every rank); the others go on to the next step."""
        if self.world.rank == 0:
            super().validate()

    def past(self, deadline: float | None) -> bool:
        """Rank 0's clock decides, so every rank stops after the same step."""
        late = torch.tensor([int(super().past(deadline))], device=self.device)
        dist.broadcast(late, 0)
        return bool(late.item())

    def save_checkpoint(self) -> None:
        """Rank 0 writes the one-process checkpoint in --out, then every rank reports it (Ray Train persists it)."""
        opt_state = self._zero_state() if self.world.zero else None
        state = self.checkpoint_state(opt_state) if self.world.rank == 0 else None
        stage = None
        if state is not None:
            stage = self.out / "checkpoint-stage"
            stage.mkdir(exist_ok=True)
            tmp = stage / (CKPT + ".tmp")
            torch.save(state, tmp)
            tmp.replace(stage / CKPT)
            _link_or_copy(stage / CKPT, self.out / CKPT)
        if self.report is not None:
            self.report({"step": self.step, "tokens": self.tokens}, stage)

    def finish(self, save: Path | None, command: str) -> None:
        """Rank 0 writes the trained draft."""
        if save is not None and self.world.rank == 0:
            self.save_draft(save, command)


def _link_or_copy(src: Path, dst: Path) -> None:
    """dst becomes src's content atomically (a hard link renamed into place; a copy where links are not possible)."""
    tmp = dst.with_name(dst.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        import shutil

        shutil.copyfile(src, tmp)
    tmp.replace(dst)
