"""A cache of the KD targets' top-k logits at every labelled position of the packed training rows.

KD with the target's full distribution runs the target's forward (30 layers for SmolLM2-135M) at every step, for
every epoch and every run on the same data: most of a step's time. The cache runs it once, storing per labelled
position the k largest logits over the FULL vocabulary (float16) and their ids (int16, offset by 2^15: vocabularies
up to 65,536), so one cache serves any reduced draft vocabulary; 4 bytes per id and logit. Files are written per
chunk of rows, atomically, so building resumes after a kill; a trainer builds them lazily, in the order it visits
the rows (`TopKCache`).

Contract of the cached loss (`TopK` in forward.py): the target's distribution is its softmax over the cached ids
that are in the draft's vocabulary, renormalised (at the KD temperature); KL(target || draft) sums over those ids.
With k covering the draft's vocabulary this is exactly the full-logit KD.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .data import Packed, stack_rows
from .forward import SubVocab, TopK, module_device, target_logits

logger = logging.getLogger(__name__)
META = "kdcache.json"
ID_OFFSET = 32768  # ids are stored as int16 minus this offset
GPU_CHUNKS_PER_FORWARD = 16  # chunks of rows per target forward when building off the CPU (KD targets are small)


def rows_fingerprint(rows: list[Packed]) -> str:
    """A hash of the packed rows (ids, labels, positions, documents): a cache fits exactly these rows."""
    digest = hashlib.sha256()
    for r in rows:
        for t in (r.ids, r.labels, r.positions, r.doc):
            digest.update(t.to(torch.int64).numpy().tobytes())
    return digest.hexdigest()[:16]


class TopKCache:
    """One target's cached top-k logits for a list of packed rows, in `directory`.

    Rows are grouped into chunks of `chunk_rows` in `order` (default: row index; a trainer passes its first epoch's
    visiting order), one part file per chunk. `build` computes missing chunks up front; with a model `attach`ed,
    `lookup` computes a missing chunk (and, off the CPU, the next missing ones) when a batch first needs it. Built in
    visiting order, a run that is interrupted and resumed on a machine without the cache (a new checkout) rebuilds
    only the chunks still ahead of it, so the cache costs each target forward once per row however often the run
    moves, and nothing that large has to travel."""

    def __init__(self, directory: Path, target: str, rows: list[Packed], k: int, dtype: str,
                 chunk_rows: int = 4, order: list[int] | None = None) -> None:
        self.directory = Path(directory)
        self.rows, self.k, self.chunk_rows = rows, k, chunk_rows
        self.order = list(range(len(rows))) if order is None else list(order)
        if sorted(self.order) != list(range(len(rows))):
            raise ValueError("a KD cache's order must visit every packed row once")
        by_index = self.order == list(range(len(rows)))
        order_key = "index" if by_index else hashlib.sha256(str(self.order).encode()).hexdigest()[:16]
        self.meta = {"target": target, "k": k, "dtype": dtype, "rows": len(rows), "chunk_rows": chunk_rows,
                     "fingerprint": rows_fingerprint(rows), "order": order_key}
        self._where = {r: divmod(n, chunk_rows) for n, r in enumerate(self.order)}  # row -> (chunk, slot)
        self._parts: dict[int, dict] = {}  # loaded chunks: values, ids, offsets (per slot)
        self._checked = False
        self.builder: torch.nn.Module | None = None
        self.chunks_per_forward = 1
        self.built = 0  # chunks this process computed (lazily or not)

    def _part(self, c: int) -> Path:
        return self.directory / f"part-{c:06d}.pt"

    def _chunks(self) -> range:
        return range(0, -(-len(self.rows) // self.chunk_rows))

    def _rows_of(self, c: int) -> list[Packed]:
        return [self.rows[r] for r in self.order[c * self.chunk_rows : (c + 1) * self.chunk_rows]]

    def _check_meta(self) -> None:
        """Refuse a directory built for other rows, order or settings; a new one gets this cache's metadata."""
        if self._checked:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        meta_path = self.directory / META
        if meta_path.exists():
            old = json.loads(meta_path.read_text())
            if old != self.meta:
                raise ValueError(f"KD cache {self.directory} was built for other rows or settings ({old}); "
                                 "use another --kd-cache directory")
        else:  # atomically: data-parallel workers open the same new cache at once (distributed.py)
            tmp = meta_path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(self.meta, indent=2))
            tmp.replace(meta_path)
        self._checked = True

    def missing(self) -> list[int]:
        """Chunks not written yet (all of them for a new cache); refuses a cache of other rows or settings."""
        self._check_meta()
        return [c for c in self._chunks() if not self._part(c).exists()]

    def missing_for(self, rows: list[int]) -> list[int]:
        """The chunks holding these packed rows that are not written yet, in chunk order."""
        self._check_meta()
        return sorted(c for c in {self._where[r][0] for r in rows} if not self._part(c).exists())

    def attach(self, model: torch.nn.Module, chunks_per_forward: int | None = None) -> "TopKCache":
        """Let `lookup` build missing chunks with this model (on its device) when a batch first needs them."""
        self._check_meta()
        self.builder = model
        self.chunks_per_forward = _chunks_per_forward(model, chunks_per_forward)
        return self

    def build(self, model: torch.nn.Module, progress: bool = True, chunks_per_forward: int | None = None,
              chunks: list[int] | None = None) -> int:
        """Compute the missing chunks (or those of `chunks` that are missing) with the target's forward, on the
        model's device; returns how many were computed.

        Parts hold CPU tensors, the same layout whichever device computed them. On the CPU one forward per chunk;
        elsewhere `chunks_per_forward` chunks (default 16: 64 rows of 256) share a forward, so a GPU is not bound by
        launching 30 layers' kernels for 4 rows at a time, and each chunk's slice is still written as its own part."""
        chunks_per_forward = _chunks_per_forward(model, chunks_per_forward)
        todo = self.missing() if chunks is None else [c for c in chunks if not self._part(c).exists()]
        full = SubVocab(None, model.config.vocab_size)
        bar = tqdm(total=len(todo), desc=f"KD cache {self.meta['target']}", disable=not progress or not todo)
        for g in range(0, len(todo), chunks_per_forward):
            group = todo[g : g + chunks_per_forward]
            chunk_rows = [self._rows_of(c) for c in group]
            batch = stack_rows([r for rows in chunk_rows for r in rows])
            with torch.no_grad():
                logits = target_logits(model, batch, full)
            top = logits.topk(min(self.k, logits.shape[-1]), -1)
            row_counts = (batch.labels != -100).sum(-1)  # labelled positions per row, in the logits' order
            start, first = 0, 0
            for c, rows in zip(group, chunk_rows):
                counts = row_counts[first : first + len(rows)].clone()  # its own storage: a part saves only its rows
                first += len(rows)
                end = start + int(counts.sum())
                values, ids = top.values[start:end], top.indices[start:end]
                start = end
                tmp = self._part(c).with_suffix(".tmp")
                torch.save({"values": values.half().cpu(), "ids": (ids - ID_OFFSET).short().cpu(), "counts": counts},
                           tmp)
                with open(tmp, "rb") as fh:
                    os.fsync(fh.fileno())
                tmp.replace(self._part(c))
                bar.update(1)
        bar.close()
        self.built += len(todo)
        return len(todo)

    def _get(self, c: int) -> dict:
        """Chunk c in memory: loaded from its part, or built first (with the attached model) when missing."""
        if c in self._parts:
            return self._parts[c]
        self._check_meta()
        if not self._part(c).exists():
            if self.builder is None:
                raise ValueError(f"KD cache {self.directory} is incomplete; build it first")
            # Off the CPU, the next missing chunks share the forward (stop at the first ones: no scan of the rest).
            ahead = (d for d in self._chunks()[c + 1 :] if d not in self._parts and not self._part(d).exists())
            self.build(self.builder, progress=False, chunks_per_forward=self.chunks_per_forward,
                       chunks=[c, *itertools.islice(ahead, self.chunks_per_forward - 1)])
        p = torch.load(self._part(c))
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), p["counts"].cumsum(0)])
        self._parts[c] = {"values": p["values"], "ids": p["ids"], "offsets": offsets}
        return self._parts[c]

    def load(self) -> "TopKCache":
        """Every chunk in memory (built first where missing if a model is attached)."""
        if self.missing() and self.builder is None:
            raise ValueError(f"KD cache {self.directory} is incomplete; build it first")
        for c in self._chunks():
            self._get(c)
        return self

    @property
    def values(self) -> torch.Tensor:
        """The loaded chunks' logits, in chunk order (for inspection; `lookup` is what training uses)."""
        return torch.cat([self._parts[c]["values"] for c in sorted(self._parts)])

    def lookup(self, batch: Packed, vocab: SubVocab, device: torch.device | str = "cpu") -> TopK:
        """The batch's labelled positions in order (row by row), with ids mapped into the draft's vocabulary (which
        must be on `device`), as tensors on `device`.

        The cache stays in CPU memory (GBs for the full data) and only the batch's rows travel, as stored (float16 +
        int16: 4 bytes per kept logit), widened on the device. At 2 x 256 tokens and k = 32 that is ~525 positions x
        32 x 4 B = 67 kB a step. Gathering those rows on the CPU is a small fraction of a millisecond even from a
        cache of millions of positions, and a pageable host-to-device copy of 67 kB is latency-bound (tens of us),
        against milliseconds of GPU work per step. Pinning would only let the copy overlap: pinning the whole
        cache locks GBs of host memory and costs seconds up front, pinning a staging copy per batch adds a host copy
        and a pinned allocation per step; at 67 kB neither can save more than those tens of us."""
        if batch.row is None:
            raise ValueError("a KD cache needs packed rows that carry their index (data.pack)")
        values, ids = [], []
        for r in batch.row.tolist():
            c, slot = self._where[r]
            part = self._get(c)
            lo, hi = int(part["offsets"][slot]), int(part["offsets"][slot + 1])
            values.append(part["values"][lo:hi])
            ids.append(part["ids"][lo:hi])
        values, ids = torch.cat(values).to(device), torch.cat(ids).to(device)
        return TopK.of(values.float(), ids.long() + ID_OFFSET, vocab)


def _chunks_per_forward(model: torch.nn.Module, asked: int | None) -> int:
    """Chunks per target forward for `model` (refusing a vocabulary 16-bit ids cannot hold): `asked`, else one on the
    CPU and GPU_CHUNKS_PER_FORWARD elsewhere."""
    if model.config.vocab_size > 2 * ID_OFFSET:
        raise ValueError(f"KD cache stores ids as 16 bits; vocabulary {model.config.vocab_size} is too large")
    return asked or (1 if module_device(model).type == "cpu" else GPU_CHUNKS_PER_FORWARD)


def target_cache_dir(root: Path, target: str) -> Path:
    """One subdirectory per target under --kd-cache (a target name or path, made filesystem-safe)."""
    return Path(root) / target.strip("/").replace("/", "__")
