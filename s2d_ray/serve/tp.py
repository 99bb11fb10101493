"""Tensor-parallel targets: N Ray actors in the replica's placement group form one tensor-parallel world.

Each rank builds the model on the meta device and reads only its shard of a safetensors checkpoint
(`models/shards.py`, AutoTP's split; sums through DeepSpeed's inference all-reduce); other checkpoints load whole and
DeepSpeed AutoTP keeps each rank's shard. Every score call goes to ALL ranks with identical inputs (collectives need
lockstep); rank 0's logits are the answer. Every wait is bounded: a dead or stuck rank, or a failed collective, makes
the group `broken` (calls fail fast, check_health fails, Serve replaces the replica, and the new group forms on a
fresh port) instead of hanging a request. A request every rank refuses alike (before any collective) fails alone.

LoRA adapters (a target with `lora:`) live on every rank, each holding its cut of them (serve/tp_lora.py); a runtime
load or unload goes to every rank, and a load some ranks refuse is undone on all, so the ranks hold the same adapters.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import ray
import torch
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..build import DTYPES, build_verifier, load_target, set_threads
from ..config import EngineConfig
from ..core.rows import limit_rows
from ..core.target import TargetVerifier
from ..core.types import ScoreRequest
from ..errors import ServiceUnavailableError
from ..models import canonical_source, resolve_model_dir
from ..models.shards import checkpoint_files, load_sharded, peak_rss_bytes, reset_peak_rss
from ..shm_buffers import remove_shm_buffers, unlink_when_mapped
from .app_config import TargetSpec
from .lora import score_by_adapters
from .replica import (
    device_report, process_model_thread, release_all, return_freed_memory, sized_rows,
)
from .tp_lora import group_adapter_answer, rank_bank, register_on_rank

logger = logging.getLogger(__name__)


class TPGroupError(ServiceUnavailableError):
    """The tensor-parallel group failed (a rank died, timed out or never formed): maps to HTTP 503."""


class TPRequestError(ServiceUnavailableError):
    """Every rank refused one call alike (a bad request, not a broken group): that call fails, the group stays."""


@dataclass(frozen=True)
class RankFailure:
    """A rank's answer when its call raised: `collective` when a collective failed (the group is then broken)."""

    rank: int
    error: str
    collective: bool


def is_collective_failure(exc: BaseException) -> bool:
    """Whether an exception came from the process group (a peer died or a collective failed), not from the request."""
    import torch.distributed as dist

    text = str(exc).lower()
    return isinstance(exc, (dist.DistError, TimeoutError)) or "gloo" in text or "nccl" in text


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


def score_or_failure(rank: int, verifier: TargetVerifier, requests: list[ScoreRequest],
                     expected: list[int]) -> tuple | RankFailure | None:
    """One rank's part of a score call: rank 0's answer (None on the others), or the failure as a value, so the
    group tells a request every rank refused (it stays up) from a failed collective (it is replaced)."""
    try:
        out = score_by_adapters(verifier, requests, expected)  # forwards of at most lora.max_loaded adapters each
    except Exception as exc:
        logger.warning("TP rank %d: score failed: %s: %s", rank, type(exc).__name__, exc)
        return RankFailure(rank, f"{type(exc).__name__}: {exc}", is_collective_failure(exc))
    return out if rank == 0 else None  # only rank 0 ships logits


def group_answers(method: str, answers: list) -> list:
    """The ranks' answers when none failed. Raises TPRequestError when every rank refused the call alike (the group
    is intact), TPGroupError when ranks disagree or a collective failed (the group must be replaced)."""
    failures = [a for a in answers if isinstance(a, RankFailure)]
    if not failures:
        return answers
    if len(failures) < len(answers) or any(f.collective for f in failures):
        raise TPGroupError("; ".join(f"rank {f.rank}: {f.error}" for f in failures))
    raise TPRequestError(f"every TP rank refused the {method} call: {failures[0].error}")


@ray.remote
class TPWorker:
    """One rank: loads the target, lets DeepSpeed AutoTP shard its Linear layers, scores with a TargetVerifier."""

    def __init__(self, rank: int, world_size: int, port: int, ecfg: EngineConfig,
                 spec: TargetSpec | None = None) -> None:
        self.rank, self.world_size, self.ecfg, self.spec = rank, world_size, ecfg, spec
        os.environ.update(rank_env(rank, world_size, port))
        set_threads(ecfg.num_threads)
        self.thread = process_model_thread(ecfg.num_threads)
        self.verifier: TargetVerifier | None = None
        self.lora = None  # the rank's cut of the target's LoRA adapters (serve/tp_lora.py), None without `lora:`

    async def setup(self, max_rows: int, max_slots: int) -> dict:
        return await self.thread.run(self._setup_sync, max_rows, max_slots)

    def _setup_sync(self, max_rows: int, max_slots: int) -> dict:
        import deepspeed  # heavy; only TP workers need it
        import torch.distributed as dist

        deepspeed.init_distributed(verbose=False)
        unlink_when_mapped(self.rank, dist.barrier)  # a killed rank leaves no /dev/shm file behind
        reset_peak_rss()  # the peak reported is loading's
        model, loading = self._load()
        self.lora = rank_bank(self.spec, model, loading, self.rank, self.world_size)
        self.verifier = build_verifier(model, self.ecfg, cuda_graphs=False, lora=self.lora)  # all-reduces: no graphs
        for adapter, where in (self.spec.lora.adapters.items() if self.lora is not None else ()):
            loaded = register_on_rank(self.lora, adapter, where)
            if "error" in loaded:  # every rank reads the same files: the group fails to form, naming why
                raise ValueError(f"target {self.spec.name}: {loaded['error']}")
        rows = self.spec_rows(model, max_rows, max_slots)
        limit_rows(self.verifier, rows, max_slots)
        returned = return_freed_memory()
        info = {"rank": self.rank, "backend": dist.get_backend(), "pid": os.getpid(), "loading": loading,
                "peak_rss_bytes": peak_rss_bytes(), "returned_bytes": returned, "max_rows": rows,
                **device_report(model)}
        logger.info("TP rank %d/%d ready: %s loading, peak host memory %.0f MiB", self.rank, self.world_size,
                    loading, info["peak_rss_bytes"] / 2**20)
        return info

    def _load(self) -> tuple[torch.nn.Module, str]:
        """The rank's shard: read as a shard from safetensors (`shard`), else the whole model loaded and cut by
        DeepSpeed AutoTP (`whole`)."""
        import deepspeed
        import deepspeed.comm as ds_comm

        dtype = DTYPES[self.ecfg.target.dtype]
        cache = Path(self.ecfg.cache_dir) if self.ecfg.cache_dir else None
        directory = resolve_model_dir(canonical_source(self.ecfg.target.resolved_source), cache)
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        if checkpoint_files(directory):
            model = load_sharded(directory, self.rank, self.world_size, dtype, ds_comm.inference_all_reduce,
                                 self.ecfg.trust_remote_code)
            return model.to(device), "shard"
        loaded = load_target(self.ecfg, device="cpu")  # DeepSpeed moves each rank's shard to its GPU
        engine = deepspeed.init_inference(loaded.model, tensor_parallel={"tp_size": self.world_size}, dtype=dtype,
                                          replace_with_kernel_inject=False)
        return engine.module, "whole"

    def spec_rows(self, model: torch.nn.Module, max_rows: int, max_slots: int) -> int:
        """KV rows this rank keeps: sized from its device's memory when the target sets memory_fraction."""
        return sized_rows(self.spec, model, max_slots) if self.spec is not None else max_rows

    async def score(self, requests: list[ScoreRequest], expected: list[int]) -> tuple | RankFailure | None:
        return await self.thread.run(score_or_failure, self.rank, self.verifier, requests, expected)

    async def release(self, seq_ids: list[str]) -> None:
        await self.thread.run(release_all, self.verifier, seq_ids)

    async def num_active(self) -> int:
        return await self.thread.run(lambda: self.verifier.num_active)

    async def counts(self) -> dict:
        """Live sequences, the prefix cache counters and the adapters held: every rank runs the same calls, so rank
        0's stand for all."""
        return await self.thread.run(lambda: {"num_active": self.verifier.num_active,
                                              **self.verifier.prefix_cache_stats(),
                                              **({"lora": self.lora.stats()} if self.lora is not None else {})})

    async def load_adapter(self, name: str, where: str) -> dict:
        """Register the rank's cut of an adapter between forwards: {"loaded"} or {"error"}, never an exception."""
        return await self.thread.run(register_on_rank, self.lora, name, where)

    async def unload_adapter(self, name: str) -> bool:
        return self.lora is not None and await self.thread.run(self.lora.unregister, name)

    async def ping(self) -> int:
        return self.rank


class TPGroup:
    """The replica's side of a TP target: starts the ranks in its placement group and drives them in lockstep."""

    cpu_s = 0.0  # the model threads are the ranks' (other actors): not measured here (Counted.cpu_seconds 0)
    prefix_cache: dict = {}  # rank 0's prefix cache counters and adapters as of the last `num_active` (asked first)

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
            self.workers.append(TPWorker.options(**opts).remote(rank, spec.tp_size, self.port, ecfg, spec))
        try:
            infos = ray.get([w.setup.remote(spec.max_live_sequences, max_slots) for w in self.workers],
                            timeout=spec.tp_init_timeout_s)
        except Exception as exc:
            self.close()
            raise TPGroupError(f"TP group for {spec.name} did not form within {spec.tp_init_timeout_s:.0f} s "
                               f"({type(exc).__name__}: {exc})") from exc
        self.ranks = infos
        self.max_rows = min(info["max_rows"] for info in infos)
        logger.info("TP group %s formed: %d ranks on port %d, backend %s", spec.name, self.size, self.port,
                    infos[0]["backend"])

    async def _all(self, method: str, *args, timeout: float | None = None) -> list:
        """Every rank's answer. A rank that died or timed out, a failed collective, or ranks that disagree on
        whether a call failed break the group; a call every rank refused alike only fails itself."""
        if self.broken:
            raise TPGroupError(f"TP group is broken ({self.broken}); the replica is being replaced")
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        try:
            answers = await asyncio.wait_for(asyncio.gather(*refs), timeout or self.call_timeout_s)
        except Exception as exc:
            raise self._break(method, f"{type(exc).__name__}: {exc}") from exc
        try:
            return group_answers(method, answers)
        except TPGroupError as exc:
            raise self._break(method, str(exc)) from exc

    def _break(self, method: str, why: str) -> TPGroupError:
        self.broken = f"{method}: {why}"
        logger.error("TP group broken: %s", self.broken)
        return TPGroupError(f"TP group failed during {method} ({why.split(':')[0]})")

    async def score(self, requests: list[ScoreRequest], expected: list[int]) -> tuple[list[torch.Tensor], list[int]]:
        return (await self._all("score", requests, expected))[0]

    async def release(self, seq_ids: list[str]) -> None:
        await self._all("release", seq_ids)

    async def num_active(self) -> int:
        """The most live sequences any rank holds; also refreshes rank 0's prefix cache counters for `describe`."""
        counts = await self._all("counts")
        self.prefix_cache = {k: v for k, v in counts[0].items() if k != "num_active"}
        return max(c["num_active"] for c in counts)

    async def load_adapter(self, name: str, where: str) -> dict:
        """Register an adapter on every rank: {"loaded"}, or the first rank's refusal with it registered on none."""
        answer, undo = group_adapter_answer(await self._all("load_adapter", name, where))
        if undo:
            logger.warning("TP ranks disagreed on adapter %s (%s): unloaded from every rank", name, answer["error"])
            await self._all("unload_adapter", name)
        return answer

    async def unload_adapter(self, name: str) -> bool:
        """Forget an adapter on every rank: whether any held it."""
        return any(await self._all("unload_adapter", name))

    async def check(self) -> None:
        await self._all("ping", timeout=min(self.call_timeout_s, 10.0))

    def describe(self) -> dict:
        return {"tp_size": self.size, "port": self.port, "ranks": self.ranks, "broken": self.broken,
                "device": self.ranks[0]["device"], "dtype": self.ranks[0]["dtype"], **self.prefix_cache}

    def close(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        remove_shm_buffers(self.port)

