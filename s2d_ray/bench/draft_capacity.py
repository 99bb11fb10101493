"""How much the ONE shared draft replica carries: load 1, 2, ... targets of one served app at rising concurrency and
read the draft's own counters (its `stats()`, through the router's `/stats`) before and after each level.

Per level (n targets, c concurrent streams per target, `s2d bench serve`'s load split over the targets) the report
gives the draft's busy fraction (model-thread seconds drafting / wall seconds), the share of forwards and of rows that
were shared by more than one target, rows per forward, the queueing delay each round's propose call waited before its
forward (the latency the draft adds per round beyond its own forward), and the draft's share of a target round:
(queue delay + mean forward) / mean round time, where a target's rounds run one after another, so its round time is
wall / (calls / n). All counters are differences over the level, so levels never mix (see BENCHMARKS.md, draft
capacity).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..errors import ServiceUnavailableError
from .serve import LoadRun, level_summary, run_level

BUSY_LIMIT = 0.7  # docs/SERVING.md "Sizing the draft": above this, queueing delay grows fast

COUNTERS = ("num_calls", "num_forwards", "num_rows", "num_merged_forwards", "num_merged_rows", "busy_s",
            "queue_delay_s", "uptime_s")


@dataclass
class CapacityRun:
    load: LoadRun  # url, per-target concurrency levels, request budget PER TARGET, tokens, timeouts
    targets: list[str]  # loaded 1, 2, ... at a time, in this order


def draft_delta(before: dict, after: dict, num_targets: int) -> dict:
    """The draft's activity between two stats snapshots (one replica: both must name the same one)."""
    if before.get("replica") != after.get("replica"):
        raise ServiceUnavailableError(f"the draft replica changed during the level ({before.get('replica')} -> "
                           f"{after.get('replica')}): run the bench against an app with one draft replica")
    d = {k: after[k] - before[k] for k in COUNTERS}
    calls, forwards, rows, wall = d["num_calls"], d["num_forwards"], d["num_rows"], d["uptime_s"]
    forward_s = d["busy_s"] / forwards if forwards else 0.0
    queue_s = d["queue_delay_s"] / calls if calls else 0.0
    round_s = wall * num_targets / calls if calls else 0.0
    busy = d["busy_s"] / wall if wall > 0 else 0.0
    return {
        "calls": calls, "forwards": forwards, "rows": rows, "wall_s": wall,
        "busy_fraction": busy,
        "merged_forward_share": d["num_merged_forwards"] / forwards if forwards else 0.0,
        "merged_row_share": d["num_merged_rows"] / rows if rows else 0.0,
        "rows_per_forward": rows / forwards if forwards else 0.0,
        "forward_ms": 1e3 * forward_s,
        "queue_delay_ms": 1e3 * queue_s,
        "round_ms": 1e3 * round_s,
        "draft_share_of_round": (queue_s + forward_s) / round_s if round_s else 0.0,
        "replicas_needed": max(1, math.ceil(busy / BUSY_LIMIT)),
    }


async def _draft_stats(client, url: str) -> dict:
    import httpx

    try:
        draft = (await client.get(url.rstrip("/") + "/stats", timeout=30.0)).json().get("draft")
    except (httpx.HTTPError, ValueError) as exc:
        raise ServiceUnavailableError(f"no /stats from {url}: {type(exc).__name__}: {exc}") from exc
    if not draft or "error" in draft:
        raise ServiceUnavailableError(f"{url}/stats has no draft stats (an app in mode s2d with a draft, and an "
                                      f"operator key?): {draft}")
    return draft


async def run_capacity(run: CapacityRun, prompts: list[str]) -> dict:
    """For n = 1..len(targets) and each per-target concurrency c: n x c streams (c per target), the draft's delta."""
    import httpx

    from ..hardware import load_average, machine_info

    peak = len(run.targets) * max(run.load.concurrency)
    limits = httpx.Limits(max_connections=peak + 1, max_keepalive_connections=peak + 1)
    headers = {"authorization": f"Bearer {run.load.api_key}"} if run.load.api_key else {}
    levels = []
    async with httpx.AsyncClient(limits=limits, trust_env=False, headers=headers) as client:
        for n in range(1, len(run.targets) + 1):
            models = run.targets[:n]
            load = replace(run.load, requests=run.load.requests * n)
            for c in run.load.concurrency:
                before = await _draft_stats(client, run.load.url)
                t0 = time.perf_counter()
                results = await run_level(client, load, n * c, prompts, models)
                wall = time.perf_counter() - t0
                after = await _draft_stats(client, run.load.url)
                levels.append({"targets": n, "per_target": c, **level_summary(n * c, results, wall),
                               "draft": draft_delta(before, after, n), "streams": after.get("streams")})
    settings = {**asdict(run.load), "api_key": "***" if run.load.api_key else None, "targets": run.targets}
    return {"machine": machine_info(), "run": settings, "levels": levels, "load_average_end": load_average()}


def capacity_markdown(result: dict) -> str:
    r = result["run"]
    lines = [f"{r['url']}, targets {', '.join(r['targets'])} (the first n loaded), max_tokens {r['max_tokens']}, "
             f"up to {r['requests']} requests per target / {r['max_seconds']:.0f} s per level.", "",
             "| targets | streams per target | tok/s | errors | draft busy | merged forwards | merged rows | "
             "rows / forward | forward ms | queue delay ms / round | round ms | draft share of round | "
             f"draft replicas for busy <= {BUSY_LIMIT} |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for lv in result["levels"]:
        d = lv["draft"]
        lines.append(f"| {lv['targets']} | {lv['per_target']} | {lv['throughput_tokens_per_s']:.2f} | "
                     f"{lv['errors']} | {d['busy_fraction']:.2f} | {d['merged_forward_share']:.0%} | "
                     f"{d['merged_row_share']:.0%} | {d['rows_per_forward']:.2f} | {d['forward_ms']:.1f} | "
                     f"{d['queue_delay_ms']:.1f} | {d['round_ms']:.0f} | {d['draft_share_of_round']:.0%} | "
                     f"{d['replicas_needed']} |")
    errors = sorted({e for lv in result["levels"] for e in lv["error_samples"]})
    if errors:
        lines += ["", "Errors seen: " + "; ".join(errors[:5])]
    return "\n".join(lines) + "\n"


def plot_capacity(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (("busy_fraction", "draft busy fraction", 1.0), ("queue_delay_ms", "queue delay per round (ms)", None),
              ("merged_row_share", "rows drafted in shared forwards", 1.0))
    for n in sorted({lv["targets"] for lv in result["levels"]}):
        mine = [lv for lv in result["levels"] if lv["targets"] == n]
        streams = [lv["concurrency"] for lv in mine]
        for ax, (key, _, _) in zip(axes, panels):
            ax.plot(streams, [lv["draft"][key] for lv in mine], marker="o", label=f"{n} target{'s' * (n > 1)}")
    for ax, (_, title, top) in zip(axes, panels):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams (all targets)")
        ax.set_title(title)
        if top is not None:
            ax.set_ylim(0, top)
        ax.legend(fontsize=8)
    axes[0].axhline(BUSY_LIMIT, color="grey", linestyle=":", linewidth=1)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
