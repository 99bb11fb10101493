"""Self-distillation data: the targets' own greedy responses, generated in batches with the one engine (`ar` mode).

Speculation is judged along the target's own greedy path, so that path is the best training text for a draft
(EAGLE and Medusa-2 do the same). Rows keep the exact token ids, so no re-tokenisation drift enters the labels.

Two layouts: one JSONL file for one target (small sets, e.g. held-out paths), or a directory of gzip-compressed
chunks for a LIST of targets (the training set): chunk c holds the responses of target c mod n to instructions
c*B..(c+1)*B-1 of a seeded order, written atomically, so a killed run loses at most the chunk in flight and the same
command continues it; the bytes of a chunk depend only on its rows, target and settings (gzip mtime 0).
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import random
import time
from pathlib import Path

from tqdm.auto import tqdm

from ..build import build_engine
from ..config import EngineConfig, SpecConfig, TargetConfig
from ..core.engine import GenerationRequest
from ..core.types import SamplingParams
from .data import is_heldout, read_rows, render_prompt, row_key

logger = logging.getLogger(__name__)
CHUNK_GLOB = "chunk-*.jsonl.gz"
SPEC_FILE = "selfdistill.json"


def pick_rows(path: Path, n: int | None, seed: int, split: str, sources: dict[str, float] | None = None) -> list[dict]:
    """n instruction rows of one split (train/heldout), one per distinct instruction, shuffled by seed (None: all)."""
    rows, seen = [], set()
    for row in read_rows(path):
        key = row_key(row)
        if key in seen or is_heldout(key) != (split == "heldout"):
            continue
        seen.add(key)
        rows.append(row)
    rng = random.Random(seed)
    rng.shuffle(rows)
    n = len(rows) if n is None else n
    if sources:  # weighted pick by source prefix, e.g. {"gsm8k_train": 0.25}
        picked = []
        for prefix, frac in sources.items():
            picked += [r for r in rows if str(r.get("source", "")).startswith(prefix)][: int(n * frac)]
        rest = [r for r in rows if not any(str(r.get("source", "")).startswith(p) for p in sources)]
        picked += rest[: n - len(picked)]
        rng.shuffle(picked)
        return picked
    return rows[:n]


class Responder:
    """One target's engine (`ar`, greedy): instruction rows -> self-distilled rows (prompts too long are skipped)."""

    def __init__(self, target: str, threads: int | None = None, dtype: str = "float32", max_new_tokens: int = 256,
                 max_prompt: int = 384) -> None:
        cfg = EngineConfig(target=TargetConfig(name=target, dtype=dtype), spec=SpecConfig(mode="ar"),
                           num_threads=threads)
        self.built = build_engine(cfg)
        self.target, self.max_new_tokens, self.max_prompt = target, max_new_tokens, max_prompt
        tok = self.built.target.tokenizer
        self.tok, self.eos = tok, tuple(i for i in {tok.eos_token_id} if i is not None)

    def respond(self, rows: list[dict]) -> list[dict]:
        prompts = [render_prompt(self.tok, r) for r in rows]
        keep = [i for i, p in enumerate(prompts) if len(p) <= self.max_prompt]  # long prompts: skipped, not cut
        rows, prompts = [rows[i] for i in keep], [prompts[i] for i in keep]
        reqs = [GenerationRequest(r["id"], p, self.max_new_tokens, SamplingParams(), self.eos)
                for r, p in zip(rows, prompts)]
        return [{"id": r["id"], "source": r.get("source", ""), "split_key": row_key(r), "target": self.target,
                 "prompt_ids": p, "response_ids": res.token_ids, "finish_reason": res.finish_reason}
                for r, p, res in zip(rows, prompts, self.built.engine.generate(reqs))]


def generate_responses(target: str, rows: list[dict], out: Path, max_new_tokens: int = 256, batch: int = 32,
                       max_prompt: int = 384, threads: int | None = None, dtype: str = "float32") -> int:
    """Append {id, source, prompt_ids, response_ids, finish_reason} per row to `out` (resumable: skips done ids)."""
    done = set()
    if out.exists():
        done = {json.loads(line)["id"] for line in out.read_text().splitlines() if line.strip()}
    todo = [r for r in rows if r["id"] not in done]
    responder = Responder(target, threads, dtype, max_new_tokens, max_prompt)
    out.parent.mkdir(parents=True, exist_ok=True)
    made, started = 0, time.perf_counter()
    bar = tqdm(total=len(todo), desc="self-distill", unit="resp")
    with open(out, "a") as fh:
        for s in range(0, len(todo), batch):
            chunk = todo[s : s + batch]
            for row in responder.respond(chunk):
                fh.write(json.dumps(row) + "\n")
                made += len(row["response_ids"])
            fh.flush()
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{made / (time.perf_counter() - started):.0f}")
    bar.close()
    return made


def write_chunk(path: Path, rows: list[dict]) -> None:
    """gzip JSONL, written to a temporary name and renamed: a chunk file is complete or absent (kill -9 safe)."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0) as gz:  # no name/time: same rows, same bytes
        gz.write("".join(json.dumps(r) + "\n" for r in rows).encode())
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(buf.getvalue())
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    tmp.replace(path)


def chunk_plan(num_rows: int, targets: list[str], batch: int) -> list[tuple[int, str, slice]]:
    """(chunk index, target, row slice): chunks go round-robin over the targets, so any prefix is balanced."""
    return [(c, targets[c % len(targets)], slice(s, s + batch))
            for c, s in enumerate(range(0, num_rows, batch))]


def chunk_path(out_dir: Path, c: int) -> Path:
    return out_dir / f"chunk-{c:06d}.jsonl.gz"


def open_chunk_dir(out_dir: Path, spec: dict) -> None:
    """Pin `spec` (what picked the rows and how they are generated) in out_dir; refuse a directory written with
    other settings, so a resumed run never mixes two datasets."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec_path = out_dir / SPEC_FILE
    if spec_path.exists():
        old = json.loads(spec_path.read_text())
        if old != spec:
            differ = ", ".join(k for k in sorted(set(old) | set(spec)) if old.get(k) != spec.get(k))
            raise ValueError(f"{out_dir} was generated with other settings (differing: {differ}; there: {old}); "
                             "use another --out")
    else:  # written atomically: shards starting together must not read each other's half-written file
        tmp = spec_path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(spec, indent=2))
        tmp.replace(spec_path)


def chunks_todo(out_dir: Path, plan: list[tuple[int, str, slice]], stop_after: int | None,
                shard: tuple[int, int] | None) -> list[tuple[int, str, slice]]:
    """The planned chunks not written yet (of this shard; at most stop_after of them)."""
    todo = [p for p in plan if not chunk_path(out_dir, p[0]).exists()]
    if shard is not None:
        todo = [p for p in todo if p[0] % shard[1] == shard[0]]
    return todo[:stop_after] if stop_after is not None else todo


def generate_chunks(targets: list[str], rows: list[dict], out_dir: Path, settings: dict, max_new_tokens: int = 256,
                    batch: int = 32, max_prompt: int = 384, threads: int | None = None, dtype: str = "float32",
                    stop_after: int | None = None, shard: tuple[int, int] | None = None, pool=None) -> dict:
    """Every target's responses as chunk files in `out_dir`; chunks already there are skipped (resume).

    `shard` (i, n): only chunks with index % n == i, so n processes share one directory without ever writing the
    same chunk (on a GPU, where one Python process per engine leaves the device mostly idle). `pool` (pool.py):
    Ray actors generate the chunks instead of this process; a chunk's bytes are the same either way.

    `settings` (what picked the rows) is stored with the generation settings in selfdistill.json (open_chunk_dir)."""
    spec = {**settings, "targets": targets, "max_new_tokens": max_new_tokens, "batch": batch,
            "max_prompt": max_prompt, "dtype": dtype, "rows": len(rows)}
    open_chunk_dir(out_dir, spec)
    plan = chunk_plan(len(rows), targets, batch)
    todo = chunks_todo(out_dir, plan, stop_after, shard)
    bar = tqdm(total=len(plan), initial=len(plan) - len(todo), desc="self-distill", unit="chunk")
    made, started = 0, time.perf_counter()
    responses = (pool.responses(todo, rows) if pool is not None
                 else _local_responses(todo, rows, threads, dtype, max_new_tokens, max_prompt))
    for c, target, out in responses:
        write_chunk(chunk_path(out_dir, c), out)
        made += sum(len(r["response_ids"]) for r in out)
        bar.update(1)
        rate = made / (time.perf_counter() - started)
        bar.set_postfix(tok_s=f"{rate:.0f}")
        logger.info("chunk %d (%s): %d rows, %d tokens this run, %.0f tok/s", c, target, len(out), made, rate)
    bar.close()
    done = sum(chunk_path(out_dir, c).exists() for c, _, _ in plan)
    return {"chunks_done": done, "chunks_total": len(plan), "generated_tokens": made}


def _local_responses(todo: list[tuple[int, str, slice]], rows: list[dict], threads: int | None, dtype: str,
                     max_new_tokens: int, max_prompt: int):
    """(chunk, target, response rows) for each planned chunk, generated in this process, in plan order."""
    responders: dict[str, Responder] = {}
    for c, target, sl in todo:
        if target not in responders:
            responders[target] = Responder(target, threads, dtype, max_new_tokens, max_prompt)
        yield c, target, responders[target].respond(rows[sl])
