"""DeepSpeed's CPU all-reduce buffers: one file per rank in /dev/shm, named
deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>, created when a group of ranks on one host
initialises DeepSpeed's communication and never unlinked by it (about 67 MB each). A TP target restarted by Serve,
an autoscaled replica or a training worker that Ray Train restarts leaves its files behind, and /dev/shm is host
memory: it fills until Ray's memory monitor kills workers. So each rank unlinks its own name as soon as every rank
has mapped every buffer; the memory then lives exactly as long as the ranks' mappings, however the ranks end."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

SHM_DIR = "/dev/shm"
PREFIX = "deepspeed_allreduce_buffer"


def buffer_paths(port: int | str, rank: int | None = None, shm_dir: str = SHM_DIR) -> list[Path]:
    """This user's buffer files of the group on `port` (one rank's, or every rank's)."""
    which = "*" if rank is None else str(rank)
    return sorted(Path(shm_dir).glob(f"{PREFIX}_{os.getuid()}_*_{port}_{which}"))


def _unlink(paths: list[Path]) -> int:
    removed = 0
    for path in paths:
        try:
            path.unlink()
            removed += 1
        except OSError:  # another rank or a close() got there first
            pass
    return removed


def unlink_when_mapped(rank: int, barrier: Callable[[], None], shm_dir: str = SHM_DIR) -> int:
    """Unlink this rank's buffer once every rank has mapped it. DeepSpeed's init returns on a rank only after that
    rank mapped every peer's buffer, so after `barrier` (every rank past its init) no name is needed any more. Where
    DeepSpeed made no buffer (GPUs, ranks on several hosts) no rank has one and none waits at the barrier."""
    mine = buffer_paths(os.environ.get("MASTER_PORT", ""), rank, shm_dir)
    if not mine:
        return 0
    barrier()
    return _unlink(mine)


def remove_shm_buffers(port: int, shm_dir: str = SHM_DIR) -> int:
    """Delete every rank's buffer of the group on `port`: for a group that ended before its ranks unlinked theirs
    (killed during init). Run when the ranks are gone; returns how many files were removed."""
    return _unlink(buffer_paths(port, None, shm_dir))
