"""A bounded streaming load against an OpenAI-compatible server: throughput, TTFT, inter-token latency, errors.

For each concurrency level, `c` workers send streaming `/v1/completions` requests (mixed Spec-Bench prompts) until the
level's request budget is used or its time limit passes; then the level stops by itself and the next one starts.
Inter-token latency is the gap between successive streamed chunks (a speculative server may send several tokens in
one chunk); TPOT is (latency - TTFT) / (tokens - 1) per request, as vLLM's benchmark defines it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol

from ..config import SPEC_BENCH_QUESTIONS, optional_data_file
from ..prompts import read_questions, select_questions
from .mt_bench import TwoTurns, mt_bench_chats, two_turns
from .server_clocks import timing_delta

logger = logging.getLogger(__name__)

FALLBACK_PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a Python function that reverses a linked list.",
    "Translate to German: The weather is nice today, so we will walk to the station.",
    "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many clips in total?",
]


# A system prompt of about 700 tokens that every request of the `shared-prefix` workload starts with, as chat traffic
# does: what a prefix cache saves (docs/CACHING.md).
_RULES = [
    "answer in plain English, in short paragraphs, and say so when a question is ambiguous instead of guessing",
    "show arithmetic step by step, name every quantity with its unit, and check the final number once more",
    "write code that runs as given, with type hints and a docstring, and explain any library it imports",
    "decline requests for personal data about private people, and say briefly which part cannot be answered",
    "quote sources by title and year when you rely on them, and never invent a citation or a link",
    "when asked to summarise, keep names, numbers and dates exact, and drop examples before conclusions",
    "prefer lists for steps the reader must follow in order, and prose for reasons and trade-offs",
    "if a request mixes several tasks, answer them in the order given and number each answer",
]
SHARED_SYSTEM_PROMPT = "You are a careful assistant. " + " ".join(
    f"Rule {i + 1}: {_RULES[i % len(_RULES)]}." for i in range(28))
WORKLOADS = ("mixed", "shared-prefix", "repeated", "mt-bench")


def workload_prompts(workload: str, base: list[str], requests: int | None = None) -> list[str]:
    """The prompts of a workload over `base` (the mixed prompts): `mixed` as they are; `shared-prefix` each after the
    same long system prompt; `repeated` a list twice in order (a retried or replayed batch of chats: the second pass
    finds every prompt cached and answered). The repeated list is the first `requests // 2` prompts when `requests`
    (a level's count) is given, so that a level sends both passes (prompt_index `i` and `i + requests // 2` are one
    prompt); the whole base list twice would let a level shorter than it send first answers only."""
    if workload == "shared-prefix":
        return [f"{SHARED_SYSTEM_PROMPT}\n\nQuestion: {p}" for p in base]
    if workload == "repeated":
        once = base[:max(requests // 2, 1)] if requests is not None else base
        return once + once
    if workload == "mt-bench":  # two-turn chats (bench/mt_bench.py): `base` does not apply
        return mt_bench_chats()
    if workload != "mixed":
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
    return list(base)


PAIRED_MAX_SECONDS = 3600.0  # a plain run paired with a speculative one ends when its requests do (a safety cap)


@dataclass
class LoadRun:
    url: str
    model: str
    concurrency: list[int]
    requests: int = 16  # per level (raised to the concurrency so every worker sends at least one)
    max_seconds: float = 120.0  # per level: no new request starts after this; stragglers are cancelled
    max_tokens: int = 64
    temperature: float = 0.0
    timeout: float = 120.0  # per request
    include_usage: bool = True
    api_key: str | None = None  # sent as `Authorization: Bearer <key>`; never written to results
    # Each level also runs with `speculate: false` (plain target decoding through the SAME app, processes and
    # batching), right after the speculative run: served S2D against served AR in one run, no second deployment.
    # The plain run sends exactly the requests the speculative run sent (the same prompts, in order), however long
    # that takes: where `max_seconds` ended a level, the faster variant would otherwise cover more prompts than the
    # other, and the two rates would be over different work.
    compare_plain: bool = False
    speculate: bool | None = None  # the body's `speculate` field; None: not sent (the server's default)
    # Ask for each response's generated ids (`return_token_ids`, an extension) and keep them, e.g. for the greedy
    # check (bench/greedy_check.py).
    return_token_ids: bool = False
    # Requests sent one after another before the first level, per variant, and not counted (the run's first prompts,
    # max_tokens as the levels'): a fresh server's first few requests pay one-time costs (allocations, caches, the
    # first prompt lengths), and a single short warm-up request does not cover them. The in-process twins warm up
    # too; SGLang's bench_serving and vLLM's benchmark_serving send a first request the same way. The CLI's default
    # is 4.
    warmup: int = 0
    # With an in-process twin (bench/twin.py): after the levels, this many pairs at each of `twin_concurrency`, each
    # variant served and in process on the same requests, the order alternating (served first, then twin first):
    # each ratio compares runs minutes apart, on a host whose speed can drift more than the overhead measured.
    twin_pairs: int = 0
    twin_concurrency: tuple[int, ...] = (1,)
    # The prompts' workload (`workload_prompts`); `repeated` levels also report each pass apart (`repeat_passes`).
    workload: str = "mixed"


@dataclass
class RequestResult:
    ok: bool
    latency: float
    ttft: float | None = None
    tokens: int = 0
    chunk_gaps: list[float] = field(default_factory=list)
    error: str | None = None
    prompt_index: int | None = None  # which of the run's prompts
    request_index: int | None = None  # its place in the level's order of sending (a level may cycle the prompts)
    token_ids: list[int] | None = None  # generated ids, with LoadRun.return_token_ids
    text: str = ""  # the generated text (an MT-Bench turn 2 carries turn 1's)
    turn: int | None = None  # 1 or 2 in the mt-bench workload


def mixed_prompts(questions: Path | None, max_chars: int = 4000) -> list[str]:
    """First turns of Spec-Bench questions, tasks interleaved (short chat, long summaries, math...): `questions`, else
    the data directory's question file; without either, four built-in prompts."""
    path = questions or optional_data_file(SPEC_BENCH_QUESTIONS)
    if path is None:
        logger.warning("no Spec-Bench questions (pass --questions or set S2D_DATA_DIR): four built-in prompts")
        return list(FALLBACK_PROMPTS)
    return [q.turns[0][:max_chars] for q in select_questions(read_questions(path), 8)]


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


async def one_request(client, run: LoadRun, prompt: str, model: str | None = None) -> RequestResult:
    body = {"model": model or run.model, "prompt": prompt, "max_tokens": run.max_tokens,
            "temperature": run.temperature, "stream": True}
    if run.speculate is not None:
        body["speculate"] = run.speculate
    if run.return_token_ids:
        body["return_token_ids"] = True
    if run.include_usage:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    chunks, usage_tokens = 0, None
    ids: list[int] | None = [] if run.return_token_ids else None
    texts: list[str] = []
    try:
        async with client.stream("POST", run.url.rstrip("/") + "/v1/completions", json=body,
                                 timeout=run.timeout) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                return RequestResult(False, time.perf_counter() - t0, error=f"HTTP {resp.status_code}: {text}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return RequestResult(False, time.perf_counter() - t0, error=str(chunk["error"])[:200])
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens", usage_tokens)
                if ids is not None:
                    for c in chunk.get("choices") or []:
                        if c.get("token_ids") is None:
                            ids = None  # a server without the extension: nothing to compare
                            break
                        ids += c["token_ids"]
                texts.append("".join(c.get("text") or "" for c in chunk.get("choices") or []))
                if texts[-1]:
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    first = first if first is not None else now
                    last, chunks = now, chunks + 1
    except Exception as exc:  # network errors, timeouts, bad JSON: counted, never fatal to the run
        return RequestResult(False, time.perf_counter() - t0, error=f"{type(exc).__name__}: {exc}"[:200])
    ttft = first - t0 if first is not None else None
    return RequestResult(True, time.perf_counter() - t0, ttft, usage_tokens or chunks, gaps, token_ids=ids,
                         text="".join(texts))


async def run_level(client, run: LoadRun, concurrency: int, prompts: list[str],
                    models: list[str] | None = None, by_request: bool = False) -> list[RequestResult]:
    """`concurrency` workers share one request budget; nothing new starts after max_seconds. With `models`, worker w
    asks for models[w % len(models)] (an even split of the workers over several targets), else run.model; with
    `by_request` too, request i asks for models[i % len(models)] whichever worker sends it (the same request names
    the same model in every run, so two runs' outputs compare request by request)."""
    budget = max(run.requests, concurrency)
    next_index = [0]
    results: list[RequestResult] = []
    deadline = time.perf_counter() + run.max_seconds

    async def worker(model: str | None) -> None:
        while next_index[0] < budget and time.perf_counter() < deadline:
            i = next_index[0]
            next_index[0] += 1
            item = prompts[i % len(prompts)]
            asked = models[i % len(models)] if by_request and models else model
            if isinstance(item, TwoTurns):  # mt-bench: one chat, two requests
                done = await two_turns(lambda prompt, m=asked: one_request(client, run, prompt, m), item)
            else:
                done = [await one_request(client, run, item, asked)]
            for result in done:
                result.prompt_index, result.request_index = i % len(prompts), i
                results.append(result)

    tasks = [asyncio.create_task(worker(models[w % len(models)] if models else None)) for w in range(concurrency)]
    _, pending = await asyncio.wait(tasks, timeout=run.max_seconds + run.timeout)
    for t in pending:
        t.cancel()
    return results


def level_summary(concurrency: int, results: list[RequestResult], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.chunk_gaps]
    tpot = [(r.latency - r.ttft) / (r.tokens - 1) for r in ok if r.ttft is not None and r.tokens > 1]
    ms = lambda v: None if v is None else 1e3 * v  # noqa: E731
    return {
        "concurrency": concurrency, "sent": len(results), "completed": len(ok), "errors": len(results) - len(ok),
        "wall_seconds": wall, "output_tokens": tokens, "throughput_tokens_per_s": tokens / wall if wall else 0.0,
        "requests_per_s": len(ok) / wall if wall else 0.0,
        "ttft_ms_p50": ms(percentile(ttft, 50)), "ttft_ms_p90": ms(percentile(ttft, 90)),
        "ttft_ms_p99": ms(percentile(ttft, 99)),
        "itl_ms_p50": ms(percentile(gaps, 50)), "itl_ms_p90": ms(percentile(gaps, 90)),
        "itl_ms_p99": ms(percentile(gaps, 99)),
        "tpot_ms_p50": ms(percentile(tpot, 50)), "tpot_ms_p99": ms(percentile(tpot, 99)),
        "latency_ms_p50": ms(percentile([r.latency for r in ok], 50)),
        "error_samples": sorted({r.error for r in results if r.error})[:3],
        **turn2_ttft(ok),
    }


def repeat_passes(results: list[RequestResult], half: int, skip: int = 0) -> dict:
    """The repeated workload's passes apart (the level's first `half` requests: first answers; the later ones, a
    level that cycles the list included: repeats): each pass's completed requests and its tokens per second of one
    stream (tokens over the requests' summed latency, so concurrency does not enter), and second over first. The first
    `skip` prompts are left out of both: the warm-up requests already answered them, so their first pass is a repeat
    too. A repeat at concurrency > 1 may start before its first answer ended (then the store holds nothing of it
    yet); at one request every repeat follows its first answer."""
    out = {}
    kept = [r for r in results if r.ok and r.request_index is not None and r.prompt_index % half >= skip]
    for name, done in (("first", [r for r in kept if r.request_index < half]),
                       ("second", [r for r in kept if r.request_index >= half])):
        seconds = sum(r.latency for r in done)
        out[f"{name}_pass_completed"] = len(done)
        out[f"{name}_pass_tokens_per_s_per_stream"] = sum(r.tokens for r in done) / seconds if seconds else None
    first, second = out["first_pass_tokens_per_s_per_stream"], out["second_pass_tokens_per_s_per_stream"]
    out["second_over_first"] = second / first if first and second is not None else None
    return out


def turn2_ttft(ok: list[RequestResult]) -> dict:
    """TTFT of MT-Bench turn-2 requests alone (their prompts carry turn 1 and its answer); {} for other workloads."""
    ttft = [r.ttft for r in ok if r.turn == 2 and r.ttft is not None]
    if not ttft:
        return {}
    return {"turn2_completed": len(ttft), "turn2_ttft_ms_p50": 1e3 * percentile(ttft, 50),
            "turn2_ttft_ms_p90": 1e3 * percentile(ttft, 90)}


async def server_timing(client, run: LoadRun) -> dict | None:
    """The router's round and call clocks for the run's model (`timing` in /stats; None from a server without
    them). With several router replicas, /stats answers from one of them."""
    try:
        resp = await client.get(f"{run.url}/stats", timeout=10.0)
        return resp.json()["targets"][run.model]["timing"]
    except Exception:
        return None


class InProcessTwin(Protocol):
    """What `run_load` pairs served levels with (bench/twin.py's `Twin`): the same requests decoded in this process."""

    def run(self, concurrency: int, requests: int, max_tokens: int, temperature: float, speculate: bool) -> dict:
        ...


async def run_load(run: LoadRun, prompts: list[str], twin: InProcessTwin | None = None) -> dict:
    """Every level in turn on one connection pool (loopback only; proxies from the environment are ignored); each
    level also records what it added to the server's round and call clocks (`server`), where the server has them.
    With `twin` (bench/twin.py) and `run.twin_pairs`, the served-against-in-process pairs follow (`twin`)."""
    import httpx

    from ..hardware import machine_info

    limits = httpx.Limits(max_connections=max(run.concurrency), max_keepalive_connections=max(run.concurrency))
    headers = {"authorization": f"Bearer {run.api_key}"} if run.api_key else {}
    summary, raw = [], {}
    variants = [("speculative", True), ("plain", False)] if run.compare_plain else [(None, run.speculate)]
    warmup = []
    async with httpx.AsyncClient(limits=limits, trust_env=False, headers=headers) as client:
        for label, speculate in variants:
            for i in range(run.warmup):
                item = prompts[i % len(prompts)]  # an mt-bench chat warms up with its first turn
                got = await one_request(client, replace(run, speculate=speculate),
                                        item.prompt() if isinstance(item, TwoTurns) else item)
                warmup.append({"variant": label, "ok": got.ok, "latency": got.latency, "tokens": got.tokens,
                               "error": got.error})
        for c in run.concurrency:
            sent = None  # requests the level's speculative run sent: its plain run sends the same ones
            for label, speculate in variants:
                level = replace(run, speculate=speculate)
                if sent is not None:
                    level = replace(level, requests=sent, max_seconds=PAIRED_MAX_SECONDS)
                clocks = await server_timing(client, run)
                t0 = time.perf_counter()
                results = await run_level(client, level, c, prompts)
                sent = sum(r.turn != 2 for r in results) if label == "speculative" else sent  # a chat counts once
                wall = time.perf_counter() - t0
                server = timing_delta(clocks, await server_timing(client, run))
                passes = repeat_passes(results, len(prompts) // 2, run.warmup) if run.workload == "repeated" else {}
                summary.append({**level_summary(c, results, wall), **passes, **({"variant": label} if label else {}),
                                **({"server": server} if server else {})})
                raw[f"{c}-{label}" if label else str(c)] = [asdict(r) for r in results]
                logger.info("concurrency %d %s: %s", c, label or "", summary[-1])
        pairs = await twin_pairs(client, run, prompts, twin, variants) if twin is not None else None
    settings = {**asdict(run), "api_key": "***" if run.api_key else None}
    out = {"machine": machine_info(), "run": settings, "warmup": warmup, "summary": summary, "requests": raw}
    return {**out, "twin": pairs} if pairs is not None else out


async def served_level(client, run: LoadRun, level: LoadRun, prompts: list[str], concurrency: int = 1) -> dict:
    """One served level, with what it added to the server's clocks (`server`)."""
    clocks, t0 = await server_timing(client, run), time.perf_counter()
    results = await run_level(client, level, concurrency, prompts)
    served = level_summary(concurrency, results, time.perf_counter() - t0)
    server = timing_delta(clocks, await server_timing(client, run))
    return {**served, **({"server": server} if server else {})}


async def twin_pairs(client, run: LoadRun, prompts: list[str], twin: InProcessTwin, variants) -> dict:
    """At each of `run.twin_concurrency`, `run.twin_pairs` times per variant: the served level, then the twin on the
    requests it sent (the order swapped every other pair, so a drift in the host's speed does not favour either
    side). The twin first decodes the requests once per variant, not counted, as the served app did in the levels: a
    first pass over new prompt lengths runs slower than the later ones. Medians are by variant, and by variant and
    concurrency (`"speculative@4"`) when there are several."""
    for label, speculate in variants:
        twin.run(1, max(run.requests, 1), run.max_tokens, run.temperature, speculate is not False)
    pairs = [await twin_pair(client, run, prompts, twin, c, p, label, speculate)
             for c in run.twin_concurrency for p in range(run.twin_pairs) for label, speculate in variants]
    several = len(run.twin_concurrency) > 1
    medians = {}
    for key in sorted({(x["variant"], x["concurrency"]) for x in pairs}, key=lambda k: (k[1], k[0])):
        ratios = [x["ratio"] for x in pairs if (x["variant"], x["concurrency"]) == key and x["ratio"] is not None]
        medians[f"{key[0]}@{key[1]}" if several else key[0]] = percentile(ratios, 50)
    return {"pairs": pairs, "median_ratio": medians}


async def twin_pair(client, run: LoadRun, prompts: list[str], twin: InProcessTwin, concurrency: int, p: int,
                    label: str | None, speculate: bool | None) -> dict:
    """Pair `p` of one variant at one concurrency: served then twin (twin first in odd pairs), on the same requests."""
    level = replace(run, speculate=speculate)
    served = twin_run = None
    for side in (("served", "twin") if p % 2 == 0 else ("twin", "served")):
        if side == "served":
            if twin_run is not None:  # the twin's requests, however long they take
                level = replace(level, requests=twin_run["requests"], max_seconds=PAIRED_MAX_SECONDS)
            served = await served_level(client, run, level, prompts, concurrency)
        else:
            n = served["sent"] if served is not None else max(run.requests, concurrency)
            twin_run = twin.run(concurrency, n, run.max_tokens, run.temperature, speculate is not False)
    ratio = (served["throughput_tokens_per_s"] / twin_run["throughput_tokens_per_s"]
             if twin_run["throughput_tokens_per_s"] else None)
    logger.info("twin pair %d %s at %d: served %.2f tok/s, twin %.2f, ratio %s", p, label or "", concurrency,
                served["throughput_tokens_per_s"], twin_run["throughput_tokens_per_s"], ratio)
    return {"concurrency": concurrency, "pair": p, "variant": label or "default",
            "first": "served" if p % 2 == 0 else "twin", "served": served,
            "twin": {k: v for k, v in twin_run.items() if k != "token_ids"}, "ratio": ratio,
            "equal_tokens": served["output_tokens"] == twin_run["output_tokens"]}
