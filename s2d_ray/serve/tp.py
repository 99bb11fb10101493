"""Tensor-parallel targets: N Ray actors in the replica's placement group form one DeepSpeed AutoTP world.

Every score call goes to ALL ranks with identical inputs (collectives need lockstep); rank 0's logits are the answer.
Every wait is bounded: a dead or stuck rank makes the group `broken` (calls fail fast, check_health fails, Serve
replaces the replica, and the new group forms on a fresh port) instead of hanging a request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from pathlib import Path

import ray
import torch
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..build import DTYPES, load_target, make_kernels, set_threads
from ..config import EngineConfig
from ..core.stack import limit_rows
from ..core.target import TargetVerifier
from ..core.types import ScoreRequest
from ..errors import S2DError
from .app_config import TargetSpec
from .replica import process_model_thread, release_all, return_freed_memory, score_counted

logger = logging.getLogger(__name__)


class TPGroupError(S2DError):
    """The tensor-parallel group failed (a rank died, timed out or never formed): maps to HTTP 503."""


def free_port() -> int:
    """A free TCP port on loopback: each TP group gets its own (DeepSpeed's SHM op name derives from it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """torch.distributed env of one rank. LOCAL_SIZE is mandatory: without it DeepSpeed's CPU SHM all-reduce makes
    every rank segfault silently on the first forward. On GPUs Ray shows each actor only its own device (index 0)."""
    one_visible_gpu = torch.cuda.is_available() and torch.cuda.device_count() == 1
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": "0" if one_visible_gpu else str(rank), "LOCAL_SIZE": str(world_size)}


@ray.remote
class TPWorker:
    """One rank: loads the target, lets DeepSpeed AutoTP shard its Linear layers, scores with a TargetVerifier."""

    def __init__(self, rank: int, world_size: int, port: int, ecfg: EngineConfig) -> None:
        self.rank, self.world_size, self.ecfg = rank, world_size, ecfg
        os.environ.update(rank_env(rank, world_size, port))
        set_threads(ecfg.num_threads)
        self.thread = process_model_thread(ecfg.num_threads)
        self.verifier: TargetVerifier | None = None

    async def setup(self, max_rows: int, max_slots: int) -> dict:
        return await self.thread.run(self._setup_sync, max_rows, max_slots)

    def _setup_sync(self, max_rows: int, max_slots: int) -> dict:
        import deepspeed  # heavy; only TP workers need it
        import torch.distributed as dist

        loaded = load_target(self.ecfg, device="cpu")  # DeepSpeed moves each rank's shard to its GPU
        engine = deepspeed.init_inference(
            loaded.model, tensor_parallel={"tp_size": self.world_size}, dtype=DTYPES[self.ecfg.target.dtype],
            replace_with_kernel_inject=False,
        )
        self.verifier = TargetVerifier(engine.module, cuda_graphs=False,  # all-reduces inside: not captured
                                       kernels=make_kernels(self.ecfg))
        limit_rows(self.verifier, max_rows, max_slots)
        # Every rank loaded the whole model and keeps its shard: the rest, freed, goes back to the OS.
        return {"rank": self.rank, "backend": dist.get_backend(), "pid": os.getpid(),
                "returned_bytes": return_freed_memory()}

    async def score(self, requests: list[ScoreRequest], expected: list[int]) -> tuple[list, list[int]] | None:
        out = await self.thread.run(score_counted, self.verifier, requests, expected)
        return out if self.rank == 0 else None  # only rank 0 ships logits

    async def release(self, seq_ids: list[str]) -> None:
        await self.thread.run(release_all, self.verifier, seq_ids)

    async def num_active(self) -> int:
        return await self.thread.run(lambda: self.verifier.num_active)

    async def ping(self) -> int:
        return self.rank


class TPGroup:
    """The replica's side of a TP target: starts the ranks in its placement group and drives them in lockstep."""

    cpu_s = 0.0  # the model threads are the ranks' (other actors): not measured here (Counted.cpu_seconds 0)

    def __init__(self, ecfg: EngineConfig, spec: TargetSpec, call_timeout_s: float, max_slots: int) -> None:
        self.size, self.call_timeout_s = spec.tp_size, call_timeout_s
        self.port = free_port()
        self.broken: str | None = None
        pg = get_current_placement_group()
        self.workers = []
        for rank in range(spec.tp_size):
            opts: dict = {"num_cpus": spec.tp_worker_cpus, "num_gpus": spec.tp_worker_gpus}
            if spec.tp_worker_resources:
                opts["resources"] = dict(spec.tp_worker_resources)
            if pg is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank + 1)
            self.workers.append(TPWorker.options(**opts).remote(rank, spec.tp_size, self.port, ecfg))
        try:
            infos = ray.get([w.setup.remote(spec.max_live_sequences, max_slots) for w in self.workers],
                            timeout=spec.tp_init_timeout_s)
        except Exception as exc:
            self.close()
            raise TPGroupError(f"TP group for {spec.name} did not form within {spec.tp_init_timeout_s:.0f} s "
                               f"({type(exc).__name__}: {exc})") from exc
        self.ranks = infos
        logger.info("TP group %s formed: %d ranks on port %d, backend %s", spec.name, self.size, self.port,
                    infos[0]["backend"])

    async def _all(self, method: str, *args, timeout: float | None = None) -> list:
        if self.broken:
            raise TPGroupError(f"TP group is broken ({self.broken}); the replica is being replaced")
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        try:
            return await asyncio.wait_for(asyncio.gather(*refs), timeout or self.call_timeout_s)
        except Exception as exc:
            self.broken = f"{method}: {type(exc).__name__}: {exc}"
            logger.error("TP group broken: %s", self.broken)
            raise TPGroupError(f"TP group failed during {method} ({type(exc).__name__})") from exc

    async def score(self, requests: list[ScoreRequest], expected: list[int]) -> tuple[list[torch.Tensor], list[int]]:
        return (await self._all("score", requests, expected))[0]

    async def release(self, seq_ids: list[str]) -> None:
        await self._all("release", seq_ids)

    async def num_active(self) -> int:
        counts = await self._all("num_active")
        return max(counts)

    async def check(self) -> None:
        await self._all("ping", timeout=min(self.call_timeout_s, 10.0))

    def describe(self) -> dict:
        return {"tp_size": self.size, "port": self.port, "ranks": self.ranks, "broken": self.broken}

    def close(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        remove_shm_buffers(self.port)


def remove_shm_buffers(port: int, shm_dir: str = "/dev/shm") -> int:
    """Delete DeepSpeed's CPU all-reduce buffers of the group on `port` (one ~67 MB file per rank, named
    deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>): DeepSpeed never unlinks them, and a suite or an
    autoscaling app that starts TP groups again and again would fill /dev/shm until Ray's memory monitor kills workers.
    Run when the group's ranks are gone (the mappings die with them); returns how many files were removed."""
    removed = 0
    for path in Path(shm_dir).glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
        try:
            path.unlink()
            removed += 1
        except OSError:
            pass
    return removed
