"""Replica plumbing the model deployments share: one model thread per process, idle-sequence bookkeeping, the
replica's device, and cutting batched results back into per-call lists."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Callable, NamedTuple

import torch

from ..core.sampling import compact_scores
from ..core.steps import score_steps
from ..core.types import ScoredPrompt

logger = logging.getLogger(__name__)


class ModelThread:
    """Runs model work on ONE thread: forwards never block the replica's event loop (health checks, releases keep
    answering), and a release can never interleave with a forward that is using the same KV rows."""

    def __init__(self, num_threads: int | None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="s2d-model")
        # CPU seconds the thread spent in calls (time.thread_time): against their wall time, it tells a forward slowed
        # by waiting (for a core, or for the GIL held by the replica's other threads) from a slow forward.
        self.cpu_s = 0.0
        if num_threads:
            # torch's intra-op thread count is per thread that runs ops: set it on the model thread itself.
            self._pool.submit(torch.set_num_threads, num_threads).result()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return (await self.run_timed(fn, *args))[0]

    async def run_timed(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        """fn's result and the CPU seconds the thread spent in it: a model sharing the process's thread with others
        counts its own calls."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._timed, partial(fn, *args))

    def _timed(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        start = time.thread_time()
        try:
            result = fn()
        finally:
            spent = time.thread_time() - start
            self.cpu_s += spent
        return result, spent

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class InProcessHandle:
    """A deployment handle's call shape over an object in this process: `handle.method.remote(...)` is an awaitable
    of `obj.method(...)`. The router holds the draft (`draft.placement: router`) and targets (`placement: router`) this
    way, so its draft and target clients (affinity, fallback, timing) are the same code either way; their forwards run
    on the process's model thread."""

    def __init__(self, obj: object) -> None:
        self._obj = obj

    @property
    def local(self) -> object:
        """The object itself: a client whose whole round runs on the model thread calls its `*_now` methods."""
        return self._obj

    def __getattr__(self, name: str) -> "_Method":
        return _Method(getattr(self._obj, name))


class _Method:
    def __init__(self, fn) -> None:
        self.remote = fn  # an async method: calling it makes the coroutine the caller awaits


_MODEL_THREADS: dict[int | None, ModelThread] = {}


def process_model_thread(num_threads: int | None) -> ModelThread:
    """This process's model thread (made on first use): every model in a process runs its forwards on the same one.

    libgomp gives each OS thread that starts parallel regions a pool of workers of its own; two pools whose threads
    outnumber the cores make libgomp throttle its spin-wait, so workers sleep between the regions of a forward and
    every region pays a wake-up: a draft and a target on two model threads of one router process make prefills and
    decoding markedly slower than on one. One thread also means a process's forwards never overlap, which on a CPU
    would only make them share the cores. Keyed by the thread count asked (a process asks one)."""
    thread = _MODEL_THREADS.get(num_threads)
    if thread is None:
        thread = _MODEL_THREADS[num_threads] = ModelThread(num_threads)
    return thread


class IdleSequences:
    """When each sequence id was last used, so state a dead router never released is dropped after a TTL."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._seen: dict[str, float] = {}

    def touch(self, seq_ids: list[str]) -> None:
        now = time.monotonic()
        for s in seq_ids:
            self._seen[s] = now

    def forget(self, seq_id: str) -> None:
        self._seen.pop(seq_id, None)

    def expired(self) -> list[str]:
        cutoff = time.monotonic() - self.ttl_s
        return [s for s, t in self._seen.items() if t < cutoff]


def release_all(holder: Any, seq_ids: list[str]) -> None:
    """Free each sequence's KV on a verifier or drafter (run on the model thread, like every model call)."""
    for seq_id in seq_ids:
        holder.release(seq_id)


def chunks(items: list[Any], size: int) -> list[list[Any]]:
    """Consecutive pieces of at most `size` items: a forward never holds more sequences than a replica keeps rows."""
    return [items[i : i + size] for i in range(0, len(items), size)] or [[]]


def recomputed_tokens(table: Any, requests: list[Any], expected: list[int]) -> list[int]:
    """Per request, positions an earlier round already computed (`expected`, sent by the router) that this replica's
    cache does not hold for the same prefix: KV it must compute again (the sequence moved here, or its row was
    reclaimed). Read before the forward changes the cache."""
    return [max(0, e - table.cached_prefix(r.seq_id, r.tokens)) for r, e in zip(requests, expected)]


class Counted(NamedTuple):
    """A model call's answer plus what it cost in recomputation, and where it ran (for s2d_recomputed_tokens_total
    per deployment and replica, counted by the caller so that every call is counted once); `seconds`: what the
    replica spent on the batch that served the call (its forwards and the model-thread hop), so the caller can tell
    the cost of the call itself (transport, batching, queueing) from the model's; `cpu_seconds`: the model thread's
    CPU time in it (0 where not measured), below `seconds` by what the forwards waited for a core or the GIL."""

    results: list
    recomputed: int
    replica: str
    seconds: float = 0.0
    cpu_seconds: float = 0.0


def score_counted(verifier: Any, requests: list[Any], expected: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """Recomputed tokens per request, then what it ships back: argmax ids for `argmax_only` requests (greedy, no
    logprobs; the ids of every step for a row asking `steps > 1`), a ScoredPrompt for a row scoring its prompt (the
    prompt's top-n, not its logits), else the logits; run on the model thread."""
    recomputed = recomputed_tokens(verifier.table, requests, expected)
    logits = score_steps(verifier.score, requests)
    # Each tensor pickles alone, not the whole batch's storage: host_copy always copies.
    return [host_copy(x if r.steps > 1 else compact_scores(x, r.argmax_only)) for x, r in zip(logits, requests)], \
        recomputed


def host_copy(x: Any) -> Any:
    """A CPU copy of `x` of its own storage: what crosses a deployment boundary. The router and a TP replica hold no
    GPU (Ray hides it from actors with num_gpus 0), so a CUDA tensor would fail to unpickle there. A ScoredPrompt (a
    prompt's rows reduced on the verifier) is copied field by field."""
    if isinstance(x, ScoredPrompt):
        return ScoredPrompt(*(host_copy(getattr(x, f.name)) for f in dataclasses.fields(x)))
    return x.detach().to("cpu", copy=True)


def to_host(value: Any) -> Any:
    """`value` with every tensor in it (lists, tuples, dicts, dataclasses such as a Proposal's q) on the CPU."""
    if isinstance(value, torch.Tensor):
        return value if value.device.type == "cpu" else host_copy(value)
    if isinstance(value, list):
        return [to_host(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(to_host(v) for v in value)
    if isinstance(value, dict):
        return {k: to_host(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        moved = {f.name: to_host(getattr(value, f.name)) for f in dataclasses.fields(value)
                 if isinstance(getattr(value, f.name), (torch.Tensor, list, tuple, dict))}
        return dataclasses.replace(value, **moved) if moved else value
    return value


def off_host(value: Any, where: str = "") -> list[str]:
    """Where in `value` a tensor is not on the CPU (empty: safe to ship); the deployment-boundary check tests use."""
    if isinstance(value, torch.Tensor):
        return [] if value.device.type == "cpu" else [f"{where or 'value'} on {value.device}"]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in off_host(v, f"{where}[{i}]")]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in off_host(v, f"{where}[{k!r}]")]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [p for f in dataclasses.fields(value) for p in off_host(getattr(value, f.name), f"{where}.{f.name}")]
    return []


def device_report(model: torch.nn.Module | None) -> dict[str, Any]:
    """Where a process's model runs and in which dtype, for /health: `cpu`, or `cuda:0 (<GPU name>)` with the
    process's peak and reserved device memory."""
    if model is None:
        return {"device": "cpu", "dtype": None}
    param = next(model.parameters())
    out: dict = {"device": str(param.device), "dtype": str(param.dtype).removeprefix("torch.")}
    if param.device.type == "cuda":
        out["device"] += f" ({torch.cuda.get_device_name(param.device)})"
        out["device_memory_peak_bytes"] = torch.cuda.max_memory_allocated(param.device)
        out["device_memory_reserved_bytes"] = torch.cuda.memory_reserved(param.device)
    return out


def replica_id() -> str:
    """This replica's Serve id (unique across restarts), for stats and /health."""
    from ray import serve

    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a replica (tests constructing a deployment class directly)
        return "local"


def target_window(cfg: Any, name: str) -> int:
    """AppConfig.target_window for a target, read from its model's config.json."""
    from .loaders import model_config

    spec = cfg.target(name)
    return cfg.target_window(name, model_config(spec.resolved_source, cfg.cache_dir))


def sized_rows(spec: Any, model: torch.nn.Module, max_slots: int) -> int:
    """KV rows this process keeps for the target: with `memory_fraction`, what fits in that share of its device's
    memory after the weights it holds (measured, logged); else max_live_sequences. Raises when not one row fits."""
    if spec.memory_fraction is None:
        return spec.max_live_sequences
    from ..models.capacity import device_memory_bytes

    device = next(model.parameters()).device
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    capacity = spec.capacity(model.config.to_dict(), max_slots, device_memory_bytes(str(device)), weights)
    logger.info("target %s on %s: KV sized from memory: %s", spec.name, device, capacity.describe())
    return capacity.rows


def split_like(flat: list[Any], batches: list[list[Any]]) -> list[list[Any]]:
    """Cut a flat result list back into the shapes of the batched calls it came from."""
    out, start = [], 0
    for b in batches:
        out.append(flat[start : start + len(b)])
        start += len(b)
    return out


def return_freed_memory() -> int:
    """Hand memory freed while loading back to the OS (glibc's malloc_trim): loading converts and drops whole models
    (the draft's base past its layers, dtype copies) whose pages glibc would otherwise keep in the process's RSS,
    which is what a memory limit or an autoscaler sees. Returns RSS bytes released (0 where there is no glibc)."""
    import ctypes
    import ctypes.util

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim
        before = rss()
    except (OSError, AttributeError):  # not glibc (no malloc_trim), or no /proc: nothing to trim
        return 0
    trim(0)
    return max(0, before - rss())
