"""The in-process twin of a served level: the engine the router builds for one target (from the app's own config),
the same prompts, max_tokens and temperature, decoded in this process with the router's continuous batching (a request
joins between rounds while fewer than `concurrency` run; a client's next request arrives when its last one ended).

Served tok/s over twin tok/s is what serving costs. Measured once before a served run, the twin is not a fair
reference on a shared host, whose speed can drift by more than that cost within minutes. `s2d bench serve --twin`
therefore alternates the two, served then twin then twin then served, so each ratio compares runs minutes apart, and
reports every pair.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..build import Built, build_engine
from ..core.engine import GenerationRequest
from ..core.types import SamplingParams
from ..errors import ConfigError
from ..gc_pauses import gc_pauses
from ..prompts import encode_prompt
from .server_clocks import spent_delta


@dataclass
class Twin:
    built: Built
    prompt_ids: list[list[int]]  # the bench's prompts, encoded as the router encodes a /v1/completions prompt
    eos: tuple[int, ...]

    def run(self, concurrency: int, requests: int, max_tokens: int, temperature: float = 0.0,
            speculate: bool = True) -> dict:
        """One level in this process (`run_twin_level`)."""
        return run_twin_level(self, concurrency, requests, max_tokens, temperature, speculate)


def build_twin(app, model: str, prompts: list[str]) -> Twin:
    """`app`: the served AppConfig (serve/app_config.py); the engine is `app.engine_config(model)` built here, with the
    router's `plain_steps`."""
    names = [t.name for t in app.targets]
    if model not in names:
        raise ConfigError(f"--twin: the app serves no target {model!r}; it serves {names}")
    spec = app.target(model)
    if spec.tp_size > 1:
        raise ConfigError(f"--twin compares a target decoded in one process; {model} has tp_size {spec.tp_size}")
    built = build_engine(app.engine_config(model), plain_steps=spec.plain_steps)
    tok = built.target.tokenizer
    eos = tuple(i for i in {tok.eos_token_id} if i is not None)
    return Twin(built, [encode_prompt(tok, p, chat=False) for p in prompts], eos)


def run_twin_level(twin: Twin, concurrency: int, requests: int, max_tokens: int, temperature: float = 0.0,
                   speculate: bool = True) -> dict:
    """`requests` requests (prompts taken in turn, as a served level takes them), `concurrency` clients
    in a closed loop. tok/s = generated tokens / wall, as the served level counts them; rounds are split into those
    that filled a prompt and the others (their ms by rows decoded), and the load-aware budget's account by kind."""
    eng = twin.built.engine
    params = SamplingParams(temperature=temperature)
    n_prompts = len(twin.prompt_ids)
    todo = [GenerationRequest(f"twin-{i}", twin.prompt_ids[i % n_prompts], max_tokens, params, twin.eos,
                              speculate=speculate) for i in range(requests)]
    spent_before = eng.budget.spent_by_kind() if eng.budget is not None else None
    profile_before = eng.profile.snapshot()
    pauses = gc_pauses()
    gc_before = (sum(pauses.count), sum(pauses.seconds))
    outputs: dict[str, list[int]] = {r.seq_id: [] for r in todo}
    rounds: list[tuple[float, int, int]] = []  # (seconds, rows, prompt tokens that joined)
    drafted = accepted = 0
    free, t0 = concurrency, time.perf_counter()
    while todo or eng.has_unfinished:
        joined = 0
        while todo and free > 0:
            req = todo.pop(0)
            eng.add_request(req)
            free, joined = free - 1, joined + len(req.prompt_ids)
        rows, start = len(eng.seqs), time.perf_counter()
        outs = eng.step()
        rounds.append((time.perf_counter() - start, rows, joined))
        for o in outs:
            outputs[o.seq_id] += o.new_tokens
            free += o.finished
            if o.finished and o.metrics:
                drafted += o.metrics.get("num_draft_tokens", 0)
                accepted += o.metrics.get("num_accepted_draft_tokens", 0)
    wall = time.perf_counter() - t0
    tokens = sum(len(v) for v in outputs.values())
    filled = [r for r in rounds if r[2]]
    decode = [r for r in rounds if not r[2]]
    by_rows = sorted({r[1] for r in decode})
    return {
        "concurrency": concurrency, "requests": requests, "speculate": speculate, "output_tokens": tokens,
        "wall_seconds": wall, "throughput_tokens_per_s": tokens / wall if wall else 0.0, "rounds": len(rounds),
        "num_draft_tokens": drafted, "num_accepted_draft_tokens": accepted,
        "prompt_rounds": len(filled), "prompt_round_s": sum(r[0] for r in filled),
        "decode_round_s": sum(r[0] for r in decode),
        "decode_ms_by_rows": {k: 1e3 * sum(r[0] for r in decode if r[1] == k) / sum(1 for r in decode if r[1] == k)
                              for k in by_rows},
        "prompt_detail": [(round(r[0], 4), r[1], r[2]) for r in filled],  # (s, rows, prompt tokens that joined)
        "gc": {"collections": sum(pauses.count) - gc_before[0],
               "ms": round(1e3 * (sum(pauses.seconds) - gc_before[1]), 1)},  # this process's pauses in the level
        "spent": spent_delta(spent_before, eng.budget.spent_by_kind()) if eng.budget is not None else None,
        # ms per token by part (draft, verify, prompt, host) of speculative and plain rounds (core/profile.py)
        "profile": eng.profile.since(profile_before),
        "token_ids": [outputs[f"twin-{i}"] for i in range(requests)],
    }

