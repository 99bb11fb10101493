"""Per-step costs on this machine: the numbers that decide whether speculation can pay at all.

- target decode step (1 new position) and verification of k draft tokens (k + 1 positions, as in an engine round);
- the verify grid: one target forward over B rows x n positions (what load-aware speculation reads), and what each
  extra row adds to a draft step;
- one draft step per exit (propose with k = 1), and the adaptive draft in a real run (ms per draft token, exit mix);
- the engine's `ar` mode against transformers `generate` greedy on the same prompts (tokens/s, interleaved);
- engine overhead per round at batch 1: wall time outside module forwards (embedding, decoder layers, norm, head,
  rotary), measured with forward hooks, and the engine's own split (draft / target / elsewhere).
Medians over repeats, measured in one process with the same thread count for everything.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import torch
from torch import nn

from ..build import build_draft, build_drafter, build_verifier, load_profile, load_target, set_threads
from ..config import SPEC_BENCH_QUESTIONS, EngineConfig, optional_data_file
from ..core.draft import SortedDraft
from ..core.kernels import Kernels
from ..core.types import DraftRequest, SamplingParams, ScoreRequest
from ..models import LoadedModel
from ..prompts import sample_prompts
from ..hardware import machine_info
from ..train.calibrate import context_ids, measure_verify_grid
from .methods import EngineMethod, HFGenerate, with_mode

logger = logging.getLogger(__name__)


@dataclass
class StepsRun:
    context: int = 256
    repeats: int = 20
    max_k: int = 8
    gen_tokens: int = 64
    gen_prompts: int = 3
    questions: Path | None = None


def timed_ms(fn, repeats: int, warmup: int = 2) -> dict:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"median_ms": median(times), "p10_ms": times[len(times) // 10], "p90_ms": times[(len(times) * 9) // 10]}


# --- target and draft steps ------------------------------------------------------------------------------------------
def target_steps(model: nn.Module, ctx: list[int], max_k: int, repeats: int, kernels: Kernels) -> dict:
    """Decode step, and verification of k draft tokens = one forward over k + 1 positions (k + 1 logits), on the
    kernels the engine runs (`kernels`: the config's backend)."""
    verifier = build_verifier(model, kernels=kernels)
    verifier.score([ScoreRequest("s", ctx, 1)])  # prefill; later calls recompute only the tail
    drafts = ctx[-max_k - 1:][::-1]  # real token ids; values do not change the cost
    out = {"decode": timed_ms(lambda: verifier.score([ScoreRequest("s", ctx + drafts[:1], 1)]), repeats)}
    for k in range(1, max_k + 1):
        out[f"verify_{k}"] = timed_ms(lambda k=k: verifier.score([ScoreRequest("s", ctx + drafts[:k], k + 1)]), repeats)
    verifier.release("s")
    return out


def draft_step(draft: SortedDraft, ctx: list[int], repeats: int) -> dict:
    """One propose(k=1): the new token alternates, so each call runs exactly one position through the draft."""
    drafter = build_drafter(draft)
    nxt = [ctx[-1], next(t for t in ctx if t != ctx[-1])]  # two different tokens: the prefix cut is always len(ctx)
    exits: list[int] = []
    calls = [0]

    def one() -> None:
        calls[0] += 1
        prop = drafter.propose([DraftRequest("s", ctx + [nxt[calls[0] % 2]], 1, SamplingParams())])[0]
        exits.extend(prop.exits)

    drafter.propose([DraftRequest("s", ctx + [nxt[0]], 1, SamplingParams())])  # prefill
    one(), one()  # warm-up, not counted
    exits.clear()
    res = timed_ms(one, repeats, warmup=0)
    res["exits"] = {str(e): exits.count(e) for e in sorted(set(exits))}
    drafter.release("s")
    return res


def draft_steps(draft: SortedDraft, ctx: list[int], repeats: int) -> dict:
    out = {f"exit:{e}": draft_step(draft.with_exits([e], [0.0]), ctx, repeats) for e in draft.spec.exit_layers}
    out["s2d (fixed context)"] = draft_step(draft, ctx, repeats)
    return out


def head_steps(draft: SortedDraft, repeats: int, rows: tuple[int, ...] = (1, 2, 3, 5, 9)) -> dict:
    """The shared final norm + LM head for n positions: every exit a draft token visits pays it again, and a
    verification pays it for k + 1 positions (CPU matmul kernels for 2-3 rows can be slower than for 5)."""
    out = {}
    with torch.no_grad():
        for n in rows:
            h = torch.randn(n, draft.parts.embed.weight.shape[1], dtype=draft.stack.dtype)
            out[str(n)] = timed_ms(lambda h=h: draft.stack.logits(h), repeats)
    return out


# --- whole generations -----------------------------------------------------------------------------------------------
def ar_vs_generate(cfg: EngineConfig, target: LoadedModel, prompts: list[list[int]], n: int, pairs: int = 3) -> dict:
    """Back-to-back pairs, order alternating, several per prompt; the median pair ratio resists load spikes."""
    eos = target.tokenizer.eos_token_id
    hf, ar = HFGenerate(target.model, eos), EngineMethod(with_mode(cfg, "ar"), target, eos)
    params = SamplingParams()
    for m in (hf, ar):
        m.generate(prompts[0], 8, params)
    rows = []
    for i, p in enumerate(prompts):
        for j in range(pairs):
            res = {}
            for m in ((hf, ar) if (i + j) % 2 == 0 else (ar, hf)):
                t0 = time.perf_counter()
                toks, _ = m.generate(p, n, params)
                res[m.name] = (toks, time.perf_counter() - t0)
            tps = {k: len(v[0]) / v[1] for k, v in res.items()}
            rows.append({"prompt_tokens": len(p), "tokens": len(res["ar"][0]), "hf_generate_tps": tps["hf-generate"],
                         "ar_tps": tps["ar"], "ratio": tps["ar"] / tps["hf-generate"],
                         "same_tokens": res["ar"][0] == res["hf-generate"][0]})
    ratios = [r["ratio"] for r in rows]
    return {"prompts": rows, "mean_ratio": sum(ratios) / len(ratios), "median_ratio": median(ratios)}


class ForwardTimer:
    """Wall time inside the given modules' forwards (pre/post hooks; the modules never nest)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = list({id(m): m for m in modules}.values())
        self.seconds, self._t0, self._handles = 0.0, 0.0, []

    def _pre(self, *_):
        self._t0 = time.perf_counter()

    def _post(self, *_):
        self.seconds += time.perf_counter() - self._t0

    def __enter__(self) -> "ForwardTimer":
        for m in self.modules:
            self._handles += [m.register_forward_pre_hook(self._pre), m.register_forward_hook(self._post)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()


def forward_modules(method: EngineMethod) -> list[nn.Module]:
    built = method.built
    parts = [built.engine.verifier.stack.parts]
    layers = list(built.engine.verifier.stack.layers)
    if built.draft is not None:
        parts.append(built.draft.parts)
        layers += list(built.draft.layers)
    return [m for p in parts for m in (p.embed, p.norm, p.head, p.rotary)] + layers


def engine_overhead(cfg: EngineConfig, target: LoadedModel, prompts: list[list[int]], n: int, mode: str) -> dict:
    """Per round at batch 1: time outside module forwards, and the engine's own draft/target/elsewhere split."""
    method = EngineMethod(with_mode(cfg, mode), target, target.tokenizer.eos_token_id)
    method.generate(prompts[0], 8, SamplingParams())
    total = fwd = rounds = 0.0
    draft_s = target_s = 0.0
    with ForwardTimer(forward_modules(method)) as timer:
        for p in prompts:
            t0 = time.perf_counter()
            _, st = method.generate(p, n, SamplingParams())
            total += time.perf_counter() - t0
            rounds += st.num_target_forwards
            draft_s += st.draft_seconds
            target_s += st.target_seconds
        fwd = timer.seconds
    return {"mode": mode, "rounds": int(rounds), "round_ms": 1e3 * total / rounds,
            "outside_forwards_ms": 1e3 * (total - fwd) / rounds, "outside_forwards_frac": (total - fwd) / total,
            "engine_elsewhere_frac": max(total - draft_s - target_s, 0.0) / total,
            "draft_frac": draft_s / total, "target_frac": target_s / total}


def run_all(cfg: EngineConfig, run: StepsRun) -> dict:
    set_threads(cfg.num_threads)
    target = load_target(cfg)
    draft = build_draft(cfg, target, load_profile(cfg))
    questions = run.questions or optional_data_file(SPEC_BENCH_QUESTIONS)
    prompts = sample_prompts(target.tokenizer, questions, run.gen_prompts)
    ctx = context_ids(prompts, run.context)
    logger.info("steps at context %d, %d threads", len(ctx), torch.get_num_threads())
    result = {"machine": machine_info(), "target": cfg.target.name, "draft": cfg.draft.source,
              "context": len(ctx), "repeats": run.repeats, "gen_tokens": run.gen_tokens}
    result["target_steps"] = target_steps(target.model, ctx, run.max_k, run.repeats, draft.kernels)
    grid = measure_verify_grid(target.model, ctx, repeat=max(run.repeats // 3, 3), kernels=draft.kernels)
    result["verify_grid_ms"] = {str(b): {str(n): round(1e3 * t, 3) for n, t in row.items()} for b, row in grid.items()}
    logger.info("verify grid done")
    logger.info("target steps done: %s", result["target_steps"])
    result["draft_steps"] = draft_steps(draft, ctx, run.repeats)
    result["head_steps"] = head_steps(draft, run.repeats)
    logger.info("draft steps done: %s", result["draft_steps"])
    result["ar_vs_generate"] = ar_vs_generate(cfg, target, prompts, run.gen_tokens)
    logger.info("ar vs generate done: %s", result["ar_vs_generate"])
    result["overhead"] = [engine_overhead(cfg, target, prompts, run.gen_tokens, m) for m in ("ar", "s2d")]
    return result


def steps_markdown(r: dict) -> str:
    dec = r["target_steps"]["decode"]["median_ms"]
    lines = [f"Target {r['target']}, draft {r['draft']}, context {r['context']} tokens, {r['machine']['torch_threads']} "
             f"threads, {r['machine']['cpu']}, load average {_load(r['machine']['load_average'])}, median of {r['repeats']}.",
             "", "| step | median ms | p10-p90 ms | ratio to one target decode step |", "|---|---|---|---|"]
    for name, t in r["target_steps"].items():
        label = "target decode (1 position)" if name == "decode" else \
            f"target verify k={name.split('_')[1]} ({int(name.split('_')[1]) + 1} positions)"
        lines.append(f"| {label} | {t['median_ms']:.1f} | {t['p10_ms']:.1f}-{t['p90_ms']:.1f} | {t['median_ms'] / dec:.2f} |")
    for name, t in r["draft_steps"].items():
        lines.append(f"| draft {name} (exits {t['exits']}) | {t['median_ms']:.1f} | {t['p10_ms']:.1f}-{t['p90_ms']:.1f} "
                     f"| {t['median_ms'] / dec:.2f} |")
    for n, t in r["head_steps"].items():
        lines.append(f"| shared norm + LM head alone ({n} positions) | {t['median_ms']:.1f} | "
                     f"{t['p10_ms']:.1f}-{t['p90_ms']:.1f} | {t['median_ms'] / dec:.2f} |")
    if r.get("verify_grid_ms"):
        lines += ["", "One target forward over B rows x n positions, ms (median; KV prefilled to the context):", ""]
        lines += [grid_markdown(r["verify_grid_ms"])]
    a = r["ar_vs_generate"]
    lines += ["", "| prompt tokens | new tokens | hf generate tok/s | engine ar tok/s | ar / generate | same tokens |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {p['prompt_tokens']} | {p['tokens']} | {p['hf_generate_tps']:.2f} | {p['ar_tps']:.2f} | "
              f"{p['ratio']:.2f} | {p['same_tokens']} |" for p in a["prompts"]]
    lines += [f"| median (mean) of {len(a['prompts'])} pairs | | | | **{a['median_ratio']:.2f}** "
              f"({a['mean_ratio']:.2f}) | |", "",
              "| mode | rounds | ms per round | outside module forwards (ms, share) | engine elsewhere | draft | target |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {o['mode']} | {o['rounds']} | {o['round_ms']:.1f} | {o['outside_forwards_ms']:.2f} "
              f"({o['outside_forwards_frac']:.1%}) | {o['engine_elsewhere_frac']:.1%} | {o['draft_frac']:.1%} | "
              f"{o['target_frac']:.1%} |" for o in r["overhead"]]
    return "\n".join(lines) + "\n"


def grid_markdown(grid: dict) -> str:
    """{batch: {positions: ms}} as a table, one row per batch."""
    cols = list(next(iter(grid.values())))
    lines = ["| B \\ n | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += [f"| {b} | " + " | ".join(f"{row[c]:.1f}" for c in cols) + " |" for b, row in grid.items()]
    return "\n".join(lines)


def _load(values: list[float] | None) -> str:
    return "-" if not values else "/".join(f"{v:.1f}" for v in values)
