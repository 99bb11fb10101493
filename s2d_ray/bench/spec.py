"""Spec-Bench runner: every method on the same prompts, interleaved per prompt, greedy outputs checked for equality.

A question is one Spec-Bench row; MT-Bench rows have two turns, and the second turn is asked after the first turn's
answer from plain decoding (the target's own answer), so every method sees the same conversation. Methods run in an
order rotated per question, so machine drift and cache effects hit all of them alike; each is warmed up once first.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import SPEC_BENCH_QUESTIONS, data_file
from ..core.types import SamplingParams
from ..errors import ConfigError
from ..models import LoadedModel
from ..prompts import Question, encode_messages
from .methods import Method, MethodStats

logger = logging.getLogger(__name__)

BASELINE = "hf-generate"


def default_questions_path() -> Path:
    """Spec-Bench's question file under the data directory (S2D_DATA_DIR); without one, an error naming it."""
    return data_file(SPEC_BENCH_QUESTIONS, "--questions PATH")


@dataclass
class SpecRun:
    """Settings of one run (per target)."""

    max_new_tokens: int = 128
    params: SamplingParams = SamplingParams()
    warmup_tokens: int = 16
    tie_tolerance: float = 0.01  # |logit(reference token) - logit(method token)| below this: an fp32 near-tie
    progress: bool = True
    extra: dict = field(default_factory=dict)


def first_mismatch(model: torch.nn.Module, prompt: list[int], ref: list[int], out: list[int],
                   tie_tolerance: float) -> dict | None:
    """Where `out` leaves plain decoding's `ref`, and the target's top-2 logit gap there (None if equal)."""
    if out == ref:
        return None
    i = next((j for j, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ref[:i]])).logits[0, -1].double()
    top = torch.topk(logits, 2)
    gap = float(top.values[0] - top.values[1])
    ref_tok = ref[i] if i < len(ref) else None
    out_tok = out[i] if i < len(out) else None
    pair = float(logits[ref_tok] - logits[out_tok]) if ref_tok is not None and out_tok is not None else None
    # A legitimate divergence picks a token whose logit is within rounding of the best one; anything else (a
    # low-ranked token, a missing or extra token) is a bug. Rounding scales with the dtype: verifying k tokens and
    # decoding one run different kernels, and in bf16 a few units in the last place of a logit of ~16 are ~0.25.
    # And where the method's token IS the argmax of this fresh forward, it is the reference run that left the target's
    # greedy choice there (in bf16 three kernel shapes, decode, verify and this prefill, can order two tokens three
    # ways), not the method.
    rounding = 4 * torch.finfo(model.dtype).eps * float(top.values[0].abs()) if model.dtype.itemsize < 4 else 0.0
    method_is_argmax = out_tok is not None and out_tok == int(top.indices[0])
    near_tie = pair is not None and (abs(pair) < tie_tolerance + rounding or method_is_argmax)
    return {"index": i, "reference_token": ref_tok, "method_token": out_tok, "top2_gap": gap, "pair_gap": pair,
            "near_tie": near_tie, "method_is_argmax": method_is_argmax, "reference_length": len(ref),
            "method_length": len(out)}


def run_target(target_name: str, target: LoadedModel, methods: list[Method], questions: list[Question],
               run: SpecRun) -> list[dict]:
    """All questions x turns x methods on one target; returns one raw record per (question, turn, method)."""
    names = [m.name for m in methods]
    if BASELINE not in names:
        raise ConfigError(f"the method list must include {BASELINE} (speedups are measured against it)")
    if len(set(names)) != len(names):
        raise ConfigError(f"method names repeat: {names}")
    tok = target.tokenizer
    # A turn whose prompt and new tokens do not fit the target's context is skipped (with the question's later
    # turns, which build on its answer) for every method alike, not the run aborted minutes in.
    context = getattr(target.model.config, "max_position_embeddings", None)
    warm_prompt = min((encode_messages(tok, [{"role": "user", "content": q.turns[0]}]) for q in questions), key=len)
    if context is not None:
        warm_prompt = warm_prompt[-max(1, context // 2):]
    for m in methods:  # warm-up: allocations, caches, lazy inits; never timed
        m.generate(warm_prompt, min(run.warmup_tokens, run.max_new_tokens), run.params)
    total = sum(len(q.turns) for q in questions) * len(methods)
    records: list[dict] = []
    with tqdm(total=total, desc=target_name, unit="gen", disable=not run.progress, dynamic_ncols=True) as bar:
        for qi, q in enumerate(questions):
            conversation: list[dict] = []
            for turn, text in enumerate(q.turns):
                conversation.append({"role": "user", "content": text})
                prompt = encode_messages(tok, conversation)
                if context is not None and len(prompt) + run.max_new_tokens > context:
                    logger.warning("%s: q%s turn %d skipped (and its later turns): %d prompt tokens + %d new exceed "
                                   "the %d-token context", target_name, q.question_id, turn + 1, len(prompt),
                                   run.max_new_tokens, context)
                    bar.update(len(methods) * (len(q.turns) - turn))
                    break
                order = methods[qi % len(methods):] + methods[: qi % len(methods)]
                outs = {}
                for m in order:
                    bar.set_postfix_str(f"q{q.question_id} t{turn + 1} {m.name}")
                    outs[m.name] = _timed(m, prompt, run)
                    bar.update()
                records.extend(_records(target_name, target, q, turn, prompt, methods, outs, run))
                answer = tok.decode(outs[BASELINE][0], skip_special_tokens=True)
                conversation.append({"role": "assistant", "content": answer})
    return records


def _timed(m: Method, prompt: list[int], run: SpecRun) -> tuple[list[int], MethodStats, float]:
    t0 = time.perf_counter()
    tokens, stats = m.generate(prompt, run.max_new_tokens, run.params)
    return tokens, stats, time.perf_counter() - t0


def _records(target_name: str, target: LoadedModel, q: Question, turn: int, prompt: list[int],
             methods: list[Method], outs: dict, run: SpecRun) -> list[dict]:
    ref = outs[BASELINE][0]
    rows = []
    for m in methods:
        tokens, stats, seconds = outs[m.name]
        check = run.params.greedy and m.lossless and m.name != BASELINE
        mismatch = first_mismatch(target.model, prompt, ref, tokens, run.tie_tolerance) if check else None
        if mismatch is not None:
            logger.warning("%s: %s differs from %s on q%s turn %d at token %d (top-2 gap %.4f)", target_name,
                           m.name, BASELINE, q.question_id, turn + 1, mismatch["index"], mismatch["top2_gap"])
        rows.append({
            "target": target_name, "method": m.name, "question_id": q.question_id, "category": q.category,
            "task": q.task, "turn": turn + 1, "prompt_tokens": len(prompt), "new_tokens": len(tokens),
            "seconds": seconds, "tokens_per_second": len(tokens) / seconds if seconds > 0 else 0.0,
            **asdict(stats), "checked": check, "matches_baseline": (mismatch is None) if check else None,
            "mismatch": mismatch, "token_ids": tokens,
        })
    return rows
