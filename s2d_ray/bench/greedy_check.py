"""Greedy equality of a served load run: every response's token ids against the project's own engine decoding the
same prompt in process (`--mode ar`, same target, same dtype).

Lossless is the promise: greedy speculative output equals target-only greedy, token for token. In float32/float64 any
difference fails the check. In 16-bit dtypes verifying k tokens and decoding one run different kernels, so the two
can part at a rounding near-tie; each difference is reported with its position and the target's top-2 logit gap there
(`spec.first_mismatch`), and the check fails only on a difference that is not a near-tie. The responses carry their
ids (`return_token_ids`, an extension of the served API), so nothing is re-encoded from text.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from ..config import EngineConfig, SpecConfig
from ..core.engine import GenerationRequest
from ..core.types import SamplingParams
from ..prompts import encode_prompt
from .spec import first_mismatch

logger = logging.getLogger(__name__)

EXACT_DTYPES = ("float32", "float64")


@dataclass
class GreedyCheck:
    """What the reference is built from: the served target's engine config (mode forced to `ar`)."""

    engine: EngineConfig
    batch: int = 8  # prompts decoded together in process (the engine's rows are exact per row)
    tie_tolerance: float = 0.01  # as `s2d bench spec`: fp32 gaps below this are reported as near-ties (still failing)
    cache: Path | None = None  # reference ids kept across runs (keyed by target, dtype, prompt and max_tokens)


def served_outputs(result: dict) -> list[tuple[int, list[int]]]:
    """(prompt index, generated ids) of every completed request that returned its ids, over every level."""
    return [(r["prompt_index"], r["token_ids"]) for rows in result["requests"].values() for r in rows
            if r["ok"] and r.get("token_ids") is not None and r.get("prompt_index") is not None]


def _key(cfg: EngineConfig, ids: list[int], max_tokens: int) -> str:
    raw = json.dumps([cfg.target.source or cfg.target.name, cfg.target.dtype, max_tokens, ids])
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def reference_greedy(built, prompt_ids: dict[int, list[int]], max_tokens: int, check: GreedyCheck) -> dict[int, list[int]]:
    """Plain greedy ids per prompt index from the in-process `ar` engine (decoded `check.batch` prompts at a time)."""
    cache = json.loads(check.cache.read_text()) if check.cache and check.cache.exists() else {}
    keys = {i: _key(built.cfg, ids, max_tokens) for i, ids in prompt_ids.items()}
    todo = [i for i in prompt_ids if keys[i] not in cache]
    eos = tuple(i for i in {built.target.tokenizer.eos_token_id} if i is not None)
    for start in range(0, len(todo), check.batch):
        part = todo[start:start + check.batch]
        reqs = [GenerationRequest(f"ref-{i}", prompt_ids[i], max_tokens, SamplingParams(), eos) for i in part]
        for i, res in zip(part, built.engine.generate(reqs)):
            cache[keys[i]] = res.token_ids
        logger.info("greedy reference: %d / %d prompts", min(start + check.batch, len(todo)), len(todo))
    if check.cache and todo:
        check.cache.parent.mkdir(parents=True, exist_ok=True)
        check.cache.write_text(json.dumps(cache))
    return {i: cache[keys[i]] for i in prompt_ids}


def compare(model, served: list[tuple[int, list[int]]], prompt_ids: dict[int, list[int]],
            reference: dict[int, list[int]], dtype: str, tie_tolerance: float) -> dict:
    """Equal / differing counts; per difference where it starts and the target's top-2 logit gap there."""
    differences = []
    for index, ids in served:
        mm = first_mismatch(model, prompt_ids[index], reference[index], ids, tie_tolerance)
        if mm is not None:
            differences.append({"prompt_index": index, **mm})
    exact = dtype in EXACT_DTYPES
    bad = [d for d in differences if exact or not d["near_tie"]]
    return {"dtype": dtype, "checked": len(served), "equal": len(served) - len(differences),
            "differing": len(differences), "near_ties": sum(d["near_tie"] for d in differences),
            "passed": bool(served) and not bad, "differences": differences}


def check_greedy(result: dict, prompts: list[str], check: GreedyCheck) -> dict:
    """Every served greedy response of `result` (a `run_load` result) against in-process greedy for its prompt."""
    from ..build import build_engine

    if result["run"]["temperature"] != 0.0:
        raise ValueError("the greedy check needs temperature 0")
    served = served_outputs(result)
    completed = sum(r["ok"] for rows in result["requests"].values() for r in rows)
    cfg = check.engine.model_copy(update={"spec": SpecConfig(mode="ar")})
    built = build_engine(cfg)
    tok = built.target.tokenizer
    prompt_ids = {i: encode_prompt(tok, prompts[i], chat=False) for i in sorted({i for i, _ in served})}
    reference = reference_greedy(built, prompt_ids, result["run"]["max_tokens"], check)
    out = compare(built.target.model, served, prompt_ids, reference, built.cfg.target.dtype, check.tie_tolerance)
    out["unchecked"] = completed - len(served)  # completed without ids (a server without the extension)
    return out


def greedy_markdown(check: dict) -> str:
    lines = [f"Greedy check ({check['dtype']}): {check['checked']} responses, {check['equal']} equal to in-process "
             f"greedy, {check['differing']} differing ({check['near_ties']} at near-ties), {check['unchecked']} "
             f"unchecked: {'PASSED' if check['passed'] else 'FAILED'}."]
    if check["differences"]:
        lines += ["", "| prompt | token | served | in-process | top-2 logit gap | pair gap | near-tie |",
                  "|---|---|---|---|---|---|---|"]
        for d in check["differences"]:
            pair = "-" if d["pair_gap"] is None else f"{d['pair_gap']:.4f}"
            lines.append(f"| {d['prompt_index']} | {d['index']} | {d['method_token']} | {d['reference_token']} | "
                         f"{d['top2_gap']:.4f} | {pair} | {d['near_tie']} |")
    return "\n".join(lines) + "\n"
