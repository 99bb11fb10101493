"""Turning raw Spec-Bench records into the figures: Spec-Bench speedup, MAT, acceptance, exit usage; tables; plots.

Definitions (Spec-Bench): a question's tokens/s is its generated tokens over its wall time, summed over turns.
Speedup of a method = mean over questions of (its tokens/s) / (plain decoding's tokens/s on that question).
MAT (mean accepted tokens) = generated tokens per target forward, bonus token included (plain decoding = 1.00).
Acceptance rate = accepted draft tokens / drafted tokens. All pooled over the questions of a category.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path
from statistics import mean, median

from .neighbour import BUSY
from .spec import BASELINE

logger = logging.getLogger(__name__)

AR = "ar"
OVERALL = "overall"
_SUMMED = ("new_tokens", "seconds", "num_target_forwards", "num_draft_tokens", "num_accepted_draft_tokens",
           "draft_seconds", "target_seconds")


def per_question(records: list[dict]) -> dict[tuple, dict]:
    """(target, method, question_id) -> turns summed; a None in any turn keeps that field None."""
    out: dict[tuple, dict] = {}
    for r in records:
        key = (r["target"], r["method"], r["question_id"])
        q = out.setdefault(key, {"task": r["task"], "exits": defaultdict(int), "checked": 0, "equal": 0,
                                 "near_ties": 0, "mismatches": 0, **{f: 0 for f in _SUMMED}})
        for f in _SUMMED:
            q[f] = None if q[f] is None or r.get(f) is None else q[f] + r[f]
        for e, n in (r.get("exit_histogram") or {}).items():
            q["exits"][str(e)] += n
        if r.get("checked"):
            q["checked"] += 1
            mm = r.get("mismatch")
            q["equal"] += mm is None
            q["near_ties"] += bool(mm and mm["near_tie"])
            q["mismatches"] += bool(mm and not mm["near_tie"])
    for q in out.values():
        q["tps"] = q["new_tokens"] / q["seconds"] if q["seconds"] else 0.0
    return out


def is_plain(method: str) -> bool:
    """Plain (non-speculative) decoding baselines: transformers generate in any dtype, and our own `ar` (run alone:
    a method beside a busy neighbour is measured against them, not one of them)."""
    if method.endswith(BUSY):
        return False
    return method == AR or method == BASELINE or method.startswith(BASELINE + ":")


def _ratios(qs: dict, method: str, base: str, target: str, ids: list) -> list[float]:
    return [qs[(target, method, i)]["tps"] / qs[(target, base, i)]["tps"] for i in ids
            if (target, base, i) in qs and qs[(target, base, i)]["tps"] > 0]


def _mean_ratio(qs: dict, method: str, base: str, target: str, ids: list) -> float | None:
    ratios = _ratios(qs, method, base, target, ids)
    return mean(ratios) if ratios else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _row(qs: dict, target: str, method: str, ids: list) -> dict:
    rows = [qs[(target, method, i)] for i in ids]
    tot = {f: (None if any(r[f] is None for r in rows) else sum(r[f] for r in rows)) for f in _SUMMED}
    exits: dict[str, int] = defaultdict(int)
    for r in rows:
        for e, n in r["exits"].items():
            exits[e] += n
    n_exit = sum(exits.values())
    speedup = _mean_ratio(qs, method, BASELINE, target, ids)
    # Beside a busy neighbour: the same method's speed there over its speed alone, per question.
    vs_alone = _mean_ratio(qs, method, method[: -len(BUSY)], target, ids) if method.endswith(BUSY) else None
    vs_ar = _mean_ratio(qs, method, AR, target, ids) if any((target, AR, i) in qs for i in ids) else None
    # Against the FASTEST plain decoding a user could pick: every hf-generate variant (fp32, bf16) and our ar.
    plain = sorted({m for (t, m, _i) in qs if t == target and is_plain(m)})
    vs_plain = [v for b in plain if (v := _mean_ratio(qs, method, b, target, ids)) is not None]
    base_tps = [qs[(target, BASELINE, i)]["tps"] for i in ids if (target, BASELINE, i) in qs]
    split = None
    if tot["draft_seconds"] is not None and tot["seconds"]:
        d, t = tot["draft_seconds"] / tot["seconds"], tot["target_seconds"] / tot["seconds"]
        split = {"draft": d, "target": t, "other": max(1.0 - d - t, 0.0)}
    return {
        "n_questions": len(rows),
        "tokens_per_second": mean(r["tps"] for r in rows),
        "speedup": speedup,
        "speedup_vs_ar": vs_ar,
        "busy_vs_alone": vs_alone,
        "speedup_vs_best_baseline": min(vs_plain) if vs_plain else None,
        # one load spike on a baseline generation inflates a mean of ratios; the median shows it
        "speedup_median": median(r) if (r := _ratios(qs, method, BASELINE, target, ids)) else None,
        "ratio_of_mean_tps": _ratio(mean(r["tps"] for r in rows), mean(base_tps) if base_tps else None),
        "mat": _ratio(tot["new_tokens"], tot["num_target_forwards"]),
        "acceptance_rate": _ratio(tot["num_accepted_draft_tokens"], tot["num_draft_tokens"]),
        "exit_usage": {e: n / n_exit for e, n in sorted(exits.items(), key=lambda kv: int(kv[0]))} if n_exit else {},
        "time_split": split,
        "checked": sum(r["checked"] for r in rows),
        "equal": sum(r["equal"] for r in rows),
        "near_ties": sum(r["near_ties"] for r in rows),
        "mismatches": sum(r["mismatches"] for r in rows),
    }


def summarize(records: list[dict]) -> dict:
    """{target: {task | "overall": {method: row}}} in first-seen order of targets, tasks and methods."""
    qs = per_question(records)
    targets = list(dict.fromkeys(r["target"] for r in records))
    out: dict = {}
    for target in targets:
        mine = [r for r in records if r["target"] == target]
        methods = list(dict.fromkeys(r["method"] for r in mine))
        tasks = list(dict.fromkeys(r["task"] for r in mine))
        out[target] = {}
        for task in [*tasks, OVERALL]:
            ids = list(dict.fromkeys(r["question_id"] for r in mine if task in (OVERALL, r["task"])))
            out[target][task] = {m: _row(qs, target, m, [i for i in ids if (target, m, i) in qs]) for m in methods}
    return out


# --- markdown ------------------------------------------------------------------------------------------------------
def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _exits(usage: dict) -> str:
    return " ".join(f"{e}:{v:.0%}" for e, v in usage.items()) or "-"


def _split(s: dict | None) -> str:
    return "-" if s is None else f"{s['draft']:.0%}/{s['target']:.0%}/{s['other']:.0%}"


def _equal(row: dict) -> str:
    if not row["checked"]:
        return "-"
    txt = f"{row['equal']}/{row['checked']}"
    if row["near_ties"]:
        txt += f" ({row['near_ties']} near-tie)"
    if row["mismatches"]:
        txt += f" **{row['mismatches']} MISMATCH**"
    return txt


def markdown_tables(summary: dict) -> str:
    head = ("| method | tok/s | speedup | vs fastest plain (hf-generate*, ar) | MAT | accept | exit usage | time draft/target/other "
            "| greedy == plain |\n|---|---|---|---|---|---|---|---|---|\n")
    parts = []
    for target, tasks in summary.items():
        for task, rows in tasks.items():
            n = max((r["n_questions"] for r in rows.values()), default=0)
            lines = [f"| {m} | {_f(r['tokens_per_second'])} | {_f(r['speedup'], '{:.2f}x')} | "
                     f"{_f(r['speedup_vs_best_baseline'], '{:.2f}x')} | {_f(r['mat'])} | "
                     f"{_f(r['acceptance_rate'], '{:.1%}')} | {_exits(r['exit_usage'])} | {_split(r['time_split'])} | "
                     f"{_equal(r)} |" for m, r in rows.items()]
            busy = ", ".join(f"{m[: -len(BUSY)]} {_f(r['busy_vs_alone'], '{:.2f}x')}" for m, r in rows.items()
                             if r.get("busy_vs_alone") is not None)
            note = f"\nBeside a busy neighbour / alone: {busy}.\n" if busy else ""
            parts.append(f"### {target} / {task} ({n} questions)\n\n{head}" + "\n".join(lines) + "\n" + note)
    return "\n".join(parts)


# --- plots ---------------------------------------------------------------------------------------------------------
def plot_speedups(summary: dict, path: Path) -> Path:
    """Grouped bars: speedup over plain decoding per category, one bar per method; one panel per target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(summary), 1, figsize=(12, 4 * len(summary)), squeeze=False)
    for ax, (target, tasks) in zip(axes[:, 0], summary.items()):
        names = list(next(iter(tasks.values())).keys())
        width = 0.8 / max(len(names), 1)
        for j, m in enumerate(names):
            vals = [tasks[t].get(m, {}).get("speedup") or 0.0 for t in tasks]
            ax.bar([i + j * width for i in range(len(tasks))], vals, width, label=m)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(tasks))], list(tasks))
        ax.set_ylabel("speedup over hf-generate")
        ax.set_title(f"{target}: Spec-Bench speedup (mean per-question tokens/s ratio)")
        ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1.0), loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_exit_usage(summary: dict, path: Path) -> Path:
    """Stacked bars: share of draft tokens proposed at each exit, per method (all categories pooled)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(summary), 1, figsize=(9, 3.5 * len(summary)), squeeze=False)
    for ax, (target, tasks) in zip(axes[:, 0], summary.items()):
        rows = {m: r for m, r in tasks[OVERALL].items() if r["exit_usage"]}
        exits = sorted({e for r in rows.values() for e in r["exit_usage"]}, key=int)
        bottom = [0.0] * len(rows)
        for e in exits:
            vals = [r["exit_usage"].get(e, 0.0) for r in rows.values()]
            ax.bar(list(rows), vals, bottom=bottom, label=f"exit {e}")
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_ylabel("share of draft tokens")
        ax.set_title(f"{target}: exit usage")
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_outputs(out_dir: Path, meta: dict, records: list[dict]) -> dict:
    """results.json (meta, summary, every raw record), tables.md, speedup.png, exit_usage.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(records)
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "summary": summary, "records": records}, indent=1))
    tables = markdown_tables(summary)
    (out_dir / "tables.md").write_text(tables)
    plot_speedups(summary, out_dir / "speedup.png")
    plot_exit_usage(summary, out_dir / "exit_usage.png")
    logger.info("wrote %s", out_dir)
    return summary
