"""Self-distillation data: the target's own greedy responses, generated in batches with the one engine (`ar` mode).

Speculation is judged along the target's own greedy path, so that path is the best training text for a draft
(EAGLE and Medusa-2 do the same). Rows keep the exact token ids, so no re-tokenisation drift enters the labels.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from tqdm.auto import tqdm

from ..build import build_engine
from ..config import EngineConfig, SpecConfig, TargetConfig
from ..core.engine import GenerationRequest
from ..core.types import SamplingParams
from .data import is_heldout, read_rows, render_prompt, row_key

logger = logging.getLogger(__name__)


def pick_rows(path: Path, n: int, seed: int, split: str, sources: dict[str, float] | None = None) -> list[dict]:
    """n instruction rows of one split (train/heldout), one per distinct instruction, shuffled by seed."""
    import random

    rows, seen = [], set()
    for row in read_rows(path):
        key = row_key(row)
        if key in seen or is_heldout(key) != (split == "heldout"):
            continue
        seen.add(key)
        rows.append(row)
    rng = random.Random(seed)
    rng.shuffle(rows)
    if sources:  # weighted pick by source prefix, e.g. {"gsm8k_train": 0.25}
        picked = []
        for prefix, frac in sources.items():
            picked += [r for r in rows if str(r.get("source", "")).startswith(prefix)][: int(n * frac)]
        rest = [r for r in rows if not any(str(r.get("source", "")).startswith(p) for p in sources)]
        picked += rest[: n - len(picked)]
        rng.shuffle(picked)
        return picked
    return rows[:n]


def generate_responses(target: str, rows: list[dict], out: Path, max_new_tokens: int = 256, batch: int = 32,
                       max_prompt: int = 384, threads: int | None = None, dtype: str = "float32") -> int:
    """Append {id, source, prompt_ids, response_ids, finish_reason} per row to `out` (resumable: skips done ids)."""
    done = set()
    if out.exists():
        done = {json.loads(line)["id"] for line in out.read_text().splitlines() if line.strip()}
    todo = [r for r in rows if r["id"] not in done]
    cfg = EngineConfig(target=TargetConfig(name=target, dtype=dtype), spec=SpecConfig(mode="ar"), num_threads=threads)
    built = build_engine(cfg)
    tok = built.target.tokenizer
    eos = tuple(i for i in {tok.eos_token_id} if i is not None)
    out.parent.mkdir(parents=True, exist_ok=True)
    made, started = 0, time.perf_counter()
    bar = tqdm(total=len(todo), desc="self-distill", unit="resp")
    with open(out, "a") as fh:
        for s in range(0, len(todo), batch):
            chunk = todo[s : s + batch]
            prompts = [render_prompt(tok, r) for r in chunk]
            keep = [i for i, p in enumerate(prompts) if len(p) <= max_prompt]  # long prompts: skipped, not cut
            chunk, prompts = [chunk[i] for i in keep], [prompts[i] for i in keep]
            reqs = [GenerationRequest(r["id"], p, max_new_tokens, SamplingParams(), eos)
                    for r, p in zip(chunk, prompts)]
            for r, p, res in zip(chunk, prompts, built.engine.generate(reqs)):
                fh.write(json.dumps({"id": r["id"], "source": r.get("source", ""), "split_key": row_key(r),
                                     "prompt_ids": p, "response_ids": res.token_ids,
                                     "finish_reason": res.finish_reason}) + "\n")
                made += len(res.token_ids)
            fh.flush()
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{made / (time.perf_counter() - started):.0f}")
    bar.close()
    return made
