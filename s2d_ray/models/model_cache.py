"""The model cache on disk: where converted models live, and how one is published so no reader sees half of it.

A conversion builds into a staging directory beside its final place, writes a manifest of what it was built from,
and is renamed into place under a per-entry lock; an entry whose manifest matches is reused as it is.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MANIFEST_NAME = "s2d_source.json"
MANIFEST_FORMAT = 1
CHUNK = 1 << 20  # bytes hashed or copied at a time


def default_cache_dir() -> Path:
    """`$S2D_CACHE_DIR`, else `$XDG_CACHE_HOME/s2d_ray`, else `~/.cache/s2d_ray` (no platformdirs dependency)."""
    explicit = os.environ.get("S2D_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "s2d_ray"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, streamed (GGUF files are ~100 MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_tree(directory: Path) -> str:
    """sha256 over the relative names and contents of every file under `directory` (identifies an adapter)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(path.relative_to(directory).as_posix().encode() + b"\0")
        digest.update(sha256_file(path).encode())
    return digest.hexdigest()



def _read_manifest(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None


def _manifest_matches(directory: Path, expected: dict[str, Any]) -> bool:
    manifest = _read_manifest(directory)
    return manifest is not None and all(manifest.get(k) == v for k, v in expected.items())


@contextlib.contextmanager
def _exclusive_lock(final: Path) -> Iterator[None]:
    """Serialize conversions of one cache entry across processes (e.g. Ray replicas starting together)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone still keeps the cache consistent
        yield
        return
    lock_path = final.parent / f".{final.name}.lock"
    with open(lock_path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process that is preparing %s", final)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _make_readable(directory: Path) -> None:
    """mkdtemp (and safetensors) create owner-only files; a shared cache must be readable by other users."""
    directory.chmod(0o755)
    for path in directory.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _publish(staging: Path, final: Path) -> None:
    """Atomically replace `final` by `staging` (a stale `final` is moved aside first, then deleted)."""
    if final.exists():
        trash = final.with_name(f".trash-{final.name}-{uuid.uuid4().hex[:8]}")
        final.rename(trash)
        staging.rename(final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        staging.rename(final)


def materialize(
    final: Path,
    expected: dict[str, Any],
    extra: dict[str, Any],
    build: Callable[[Path], None],
) -> Path:
    """Return `final` if its manifest matches `expected`; else build into a staging dir and publish atomically."""
    expected = {"format": MANIFEST_FORMAT, **expected}
    if _manifest_matches(final, expected):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(final):
        if _manifest_matches(final, expected):  # another process finished while we waited
            return final
        for stale in final.parent.glob(f".tmp-{final.name}-*"):  # leftovers of killed conversions
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        try:
            build(staging)
            import transformers

            manifest = {**expected, **extra, "transformers": transformers.__version__, "created": time.time()}
            (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            _make_readable(staging)
            _publish(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final


