"""`s2d train-draft --num-workers N`: data-parallel SoFT on Ray Train (`TorchTrainer`), gloo on CPUs, NCCL on GPUs.

The driver only checks the cluster and starts the trainer; every worker loads the models and data itself
(distributed.py). A worker that dies restarts the whole group from the last reported checkpoint (`FailureConfig`),
and since a step depends only on the step number and the checkpointed state, the run ends where an uninterrupted
one would. Ray Train keeps its copies of the checkpoints under `<out>/ray/`; `<out>/checkpoint.pt` is the
one-process file, so `--resume` continues with any worker count, or in one process.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from .cluster import WorkerSpec, check_fits, connect
from .distributed import ZERO3_REFUSED, ZERO_STAGES, StepHook, World
from .soft import CKPT, SoftConfig

logger = logging.getLogger(__name__)
RESULT = "result.json"  # rank 0's summary of a finished multi-worker run


class ParallelTraining(BaseModel):
    """How a SoFT run is spread: workers, the gradient sharing, restarts, and the one-process run's stopping flags."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    workers: WorkerSpec = Field(default_factory=WorkerSpec, description="worker count, per-worker resources, address")
    zero: int = Field(0, description="0: DDP; 1, 2: DeepSpeed ZeRO stage (3 is refused: distributed.py)")
    max_failures: int = Field(2, ge=0, description="worker-group restarts from the last checkpoint before giving up")
    resume: bool = Field(False, description="continue from <out>/checkpoint.pt")
    stop_at: int | None = Field(None, description="stop (checkpointed) at this step")
    time_limit: float | None = Field(None, description="stop after the step that ends this many seconds after start")
    save: str | None = Field(None, description="write the trained draft here at the end")
    command: str = Field("", description="the command line, for the draft's MANIFEST")
    progress: bool = Field(True, description="rank 0 shows a progress bar")
    step_hook: StepHook | None = Field(None, description="called on every rank before each step (rank, step)")


def uses_gpu(device: str, address: str | None) -> bool:
    """`cuda`, or `auto` on a cluster that has GPUs (the driver itself may run on a CPU-only head node)."""
    if device != "auto":
        return device == "cuda"
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0 if address is not None else torch.cuda.is_available()


def train_on_ray(cfg: SoftConfig, plan: ParallelTraining) -> dict:
    """Run `cfg` on `plan.workers.num_workers` Ray Train workers; returns what the one-process run prints (steps,
    tokens, wall time, the last validation)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    if plan.zero == 3:
        raise ValueError(ZERO3_REFUSED)
    if plan.zero not in ZERO_STAGES:
        raise ValueError(f"--zero must be one of {ZERO_STAGES}, got {plan.zero}")
    spec = plan.workers
    connect(spec.address)
    gpu = uses_gpu(cfg.device, spec.address)
    spec = spec.model_copy(update={"gpus_per_worker": 1.0 if gpu else 0.0})
    check_fits(spec)
    if cfg.batch_size % spec.num_workers:
        raise ValueError(f"--batch-size {cfg.batch_size} must be a multiple of --num-workers {spec.num_workers}")
    cfg = SoftConfig(**{**asdict(cfg), "out": os.path.abspath(cfg.out), "device": "cuda" if gpu else "cpu"})
    config = {"cfg": asdict(cfg), "zero": plan.zero, "resume": plan.resume, "stop_at": plan.stop_at,
              "ends_at": None if plan.time_limit is None else time.time() + plan.time_limit, "save": plan.save,
              "command": plan.command, "progress": plan.progress, "step_hook": plan.step_hook,
              "cpus_per_worker": spec.cpus_per_worker, "cwd": os.getcwd()}
    resources = {"CPU": spec.cpus_per_worker, **({"GPU": spec.gpus_per_worker} if gpu else {})}
    trainer = TorchTrainer(
        worker_loop, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=spec.num_workers, use_gpu=gpu, resources_per_worker=resources),
        torch_config=TorchConfig(backend="nccl" if gpu else "gloo"),
        run_config=RunConfig(name=f"soft-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}",
                             storage_path=str(Path(cfg.out) / "ray"),
                             failure_config=FailureConfig(max_failures=plan.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    trainer.fit()
    return json.loads((Path(cfg.out) / RESULT).read_text())


def worker_loop(config: dict) -> None:
    """One Ray Train worker: the same run as every other rank, on its slice of each global batch."""
    import ray.train
    from ray.train import Checkpoint

    from ..build import set_threads
    from .distributed import DistributedRun

    if os.path.isdir(config["cwd"]):  # relative paths in the flags mean what they mean to the command (one node)
        os.chdir(config["cwd"])
    ctx = ray.train.get_context()
    world = World(ctx.get_world_rank(), ctx.get_world_size(), config["zero"])
    os.environ.setdefault("LOCAL_SIZE", str(ctx.get_local_world_size()))  # DeepSpeed's CPU ops read it
    cfg = SoftConfig(**config["cfg"])
    set_threads(cfg.threads or max(1, int(config["cpus_per_worker"])))  # not every core of the node per worker
    if cfg.device == "cuda":
        import ray.train.torch

        torch.cuda.set_device(ray.train.torch.get_device())

    def report(metrics: dict, stage: Path | None) -> None:
        ray.train.report(metrics, checkpoint=None if stage is None else Checkpoint.from_directory(str(stage)))

    run = DistributedRun(cfg, world, report=report, step_hook=config["step_hook"])
    restored = ray.train.get_checkpoint()
    if restored is not None:  # a restart after a failure: Ray Train's latest copy
        with restored.as_directory() as directory:
            run.start(Path(directory) / CKPT)
    else:
        mine = Path(cfg.out) / CKPT
        if config["resume"] and not mine.exists():
            logger.warning("no checkpoint in %s: starting fresh", cfg.out)
        run.start(mine if config["resume"] and mine.exists() else None)
    ends_at = config["ends_at"]
    deadline = None if ends_at is None else time.monotonic() + (ends_at - time.time())
    run.train(progress=config["progress"] and world.rank == 0, until=config["stop_at"], deadline=deadline)
    run.finish(Path(config["save"]) if config["save"] else None, config["command"])
    if world.rank == 0:  # what the one-process command prints, for the driver (RESULT)
        final = run.history[-1] if run.history else {}
        summary = {"steps": run.step, "train_tokens": run.tokens, "wall_s": round(run.wall, 1), **final}
        tmp = Path(cfg.out) / (RESULT + ".tmp")
        tmp.write_text(json.dumps(summary))
        tmp.replace(Path(cfg.out) / RESULT)
