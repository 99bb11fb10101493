"""What a served load run reports: its markdown tables (levels, S2D against plain, the in-process twin) and plots."""

from __future__ import annotations

from pathlib import Path


SPENT_KINDS = ("prompt", "draft", "catch-up", "tree", "plain")


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _level(summary: dict) -> str:
    """A level's row label: its concurrency, and the variant (speculative / plain) when the run compared both."""
    return f"{summary['concurrency']} {summary['variant']}" if "variant" in summary else str(summary["concurrency"])


def serve_markdown(result: dict) -> str:
    r = result["run"]
    lines = [f"{r['url']} model {r['model']}, max_tokens {r['max_tokens']}, temperature {r['temperature']}, "
             f"up to {r['requests']} requests / {r['max_seconds']:.0f} s per level.", "",
             "| concurrency | completed | errors | tok/s | req/s | TTFT p50/p99 ms | ITL p50/p99 ms | TPOT p50/p99 ms |",
             "|---|---|---|---|---|---|---|---|"]
    for s in result["summary"]:
        lines.append(f"| {_level(s)} | {s['completed']} | {s['errors']} | {s['throughput_tokens_per_s']:.2f} | "
                     f"{s['requests_per_s']:.2f} | {_f(s['ttft_ms_p50'])}/{_f(s['ttft_ms_p99'])} | "
                     f"{_f(s['itl_ms_p50'])}/{_f(s['itl_ms_p99'])} | {_f(s['tpot_ms_p50'])}/{_f(s['tpot_ms_p99'])} |")
    turn2 = [s for s in result["summary"] if s.get("turn2_completed")]
    if turn2:  # the mt-bench workload: second turns, whose prompt carries the first turn and its answer
        lines += ["", "| level | turn-2 requests | turn-2 TTFT p50/p90 ms |", "|---|---|---|"]
        for s in turn2:
            lines.append(f"| {_level(s)} | {s['turn2_completed']} | {_f(s.get('turn2_ttft_ms_p50'))}/"
                         f"{_f(s.get('turn2_ttft_ms_p90'))} |")
    passes = [s for s in result["summary"] if "second_over_first" in s]
    if passes:  # the repeated workload: first answers, then the same prompts again
        header = ("| level | first pass: requests, tok/s per stream | second pass: requests, tok/s per stream | "
                  "second / first |")
        lines += ["", header, "|---|---|---|---|"]
        for s in passes:
            lines.append(f"| {_level(s)} | {s['first_pass_completed']}, "
                         f"{_f(s['first_pass_tokens_per_s_per_stream'], '{:.2f}')} | {s['second_pass_completed']}, "
                         f"{_f(s['second_pass_tokens_per_s_per_stream'], '{:.2f}')} | "
                         f"{_f(s['second_over_first'], '{:.2f}')} |")
    pairs = compared_levels(result)
    if pairs:
        lines += ["", "| concurrency | speculative tok/s | plain tok/s | speculative / plain |", "|---|---|---|---|"]
        for c, spec, plain in pairs:
            ratio = spec / plain if plain else float("nan")
            lines.append(f"| {c} | {spec:.2f} | {plain:.2f} | {ratio:.2f} |")
    timed = [s for s in result["summary"] if s.get("server")]
    if timed:
        lines += ["", "Server clocks per level (the router's `timing`: rounds, and per call the wall ms, the replica's "
                  "ms, the difference (the price of the call itself), and the model thread's CPU ms in the replica; "
                  "for the draft, its ms from the call's arrival (merge hold included) and its forward's CPU ms):",
                  "", "| level | rounds | tokens / round | round ms | target calls | call ms | replica ms | overhead ms "
                  "| replica CPU ms | draft calls | draft ms | draft CPU ms | draft overhead ms |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for s in timed:
            t, tg, dr = s["server"], s["server"].get("target", {}), s["server"].get("draft", {})
            lines.append(f"| {_level(s)} | {t['rounds']} | {s['output_tokens'] / t['rounds']:.2f} | "
                         f"{t['round_ms']:.1f} | "
                         f"{tg.get('calls', 0)} | {_f(tg.get('call_ms'))} | {_f(tg.get('replica_ms'))} | "
                         f"{_f(tg.get('overhead_ms'))} | {_f(tg.get('replica_cpu_ms'))} | {dr.get('calls', 0)} | "
                         f"{_f(dr.get('replica_ms'))} | {_f(dr.get('replica_cpu_ms'))} | {_f(dr.get('overhead_ms'))} |")
    spent = [s for s in timed if s["server"].get("spent")]
    if spent:
        lines += ["", "Where each level's rounds went, by kind of round (the load-aware budget's account: rounds, "
                  "seconds (of which drafting), ms per emitted token; `catch-up`: a drafting round whose draft first "
                  "caught up on tokens since its last drafting round):", "", "| level | " + " | ".join(SPENT_KINDS) + " |",
                  "|---" * (len(SPENT_KINDS) + 1) + "|"]
        for s in spent:
            cells = []
            for kind in SPENT_KINDS:
                k = s["server"]["spent"].get(kind)
                cells.append("-" if k is None else f"{k['rounds']} / {k['seconds']:.2f} s "
                             f"({k['draft_seconds']:.2f}) / {_f(1e3 * k['seconds'] / k['tokens'] if k['tokens'] else None)}")
            lines.append(f"| {_level(s)} | " + " | ".join(cells) + " |")
    if result.get("twin"):
        lines += ["", twin_markdown(result["twin"]).rstrip("\n")]
    errors = [e for s in result["summary"] for e in s["error_samples"]]
    if errors:
        lines += ["", "Errors seen: " + "; ".join(sorted(set(errors))[:5])]
    return "\n".join(lines) + "\n"


def twin_markdown(twin: dict) -> str:
    lines = ["Served against the in-process twin (bench/twin.py: the router's engine for this target built from the "
             "app's config, the same requests, the same closed-loop clients; each pair's order alternates):", "",
             "| concurrency | pair | variant | first | served tok/s | twin tok/s | served / twin | "
             "twin prompt rounds ms | twin other rounds ms | tokens equal |", "|---|---|---|---|---|---|---|---|---|---|"]
    for x in twin["pairs"]:
        t = x["twin"]
        other = t["rounds"] - t["prompt_rounds"]
        lines.append(f"| {x['concurrency']} | {x['pair']} | {x['variant']} | {x['first']} | "
                     f"{x['served']['throughput_tokens_per_s']:.2f} | "
                     f"{t['throughput_tokens_per_s']:.2f} | {_f(x['ratio'], '{:.3f}')} | "
                     f"{_f(1e3 * t['prompt_round_s'] / t['prompt_rounds'] if t['prompt_rounds'] else None)} | "
                     f"{_f(1e3 * t['decode_round_s'] / other if other else None)} | "
                     f"{'yes' if x['equal_tokens'] else 'no'} |")
    medians = ", ".join(f"{v} {_f(r, '{:.3f}')}" for v, r in twin["median_ratio"].items())
    return "\n".join(lines + ["", f"Median served / twin: {medians}."] + profile_lines(twin["pairs"])) + "\n"


def profile_lines(pairs: list[dict]) -> list[str]:
    """The twins' rounds by kind and part (core/profile.py): where each variant's time per emitted token goes."""
    rows = [(x, kind, p) for x in pairs for kind, p in (x["twin"].get("profile") or {}).items()]
    if not rows:
        return []
    lines = ["", "Twin rounds by part, ms per emitted token (draft: the drafter's call, lookup included; prompt: "
             "verifications that carried prompt positions; host: planning, tree shaping, acceptance, commit):", "",
             "| concurrency | pair | variant | rounds | kind | draft | verify | prompt | host | total |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for x, kind, p in rows:
        lines.append(f"| {x['concurrency']} | {x['pair']} | {x['variant']} | {p['rounds']} | {kind} | "
                     f"{p['draft_ms_per_token']:.2f} | {p['verify_ms_per_token']:.2f} | "
                     f"{p['prompt_ms_per_token']:.2f} | {p['host_ms_per_token']:.2f} | {p['ms_per_token']:.2f} |")
    return lines


def compared_levels(result: dict) -> list[tuple[int, float, float]]:
    """(concurrency, speculative tok/s, plain tok/s) of a `compare_plain` run; [] otherwise."""
    by = {(s["concurrency"], s.get("variant")): s["throughput_tokens_per_s"] for s in result["summary"]}
    return [(c, by[(c, "speculative")], by[(c, "plain")]) for c in result["run"]["concurrency"]
            if (c, "speculative") in by and (c, "plain") in by]


def plot_load(result: dict, path: Path) -> Path:
    """Throughput, S2D / plain per level (with `--compare-plain`) and latency percentiles by concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = [x for x in result["summary"] if x.get("variant") in (None, "speculative")]
    c = [x["concurrency"] for x in s]
    plain = [x for x in result["summary"] if x.get("variant") == "plain"]
    levels = compared_levels(result)
    fig, axes = plt.subplots(1, 3 if levels else 2, figsize=(16 if levels else 11, 4))
    a, b = axes[0], axes[-1]
    a.plot(c, [x["throughput_tokens_per_s"] for x in s], marker="o", label="speculative")
    if plain:
        a.plot([x["concurrency"] for x in plain], [x["throughput_tokens_per_s"] for x in plain], marker="s",
               label="plain (speculate: false)")
        a.legend(fontsize=8)
    a.set_xscale("log", base=2)
    a.set_xlabel("concurrent requests")
    a.set_ylabel("output tokens/s")
    a.set_title("throughput")
    if levels:
        r = axes[1]
        r.plot([lv for lv, _, _ in levels], [sp / pl if pl else float("nan") for _, sp, pl in levels], marker="o")
        r.axhline(1.0, color="grey", lw=0.8, ls=":")
        r.set_xscale("log", base=2)
        r.set_xlabel("concurrent requests")
        r.set_ylabel("speculative / plain tok/s")
        r.set_title("S2D / plain")
    seen = []
    for key, style in (("ttft_ms", "-"), ("itl_ms", "--")):
        for q in ("p50", "p90", "p99"):
            ys = [x.get(f"{key}_{q}") for x in s]
            seen += [y for y in ys if y]
            b.plot(c, [y or float("nan") for y in ys], style, marker="o", label=f"{key[:-3]} {q}")
    b.set_xscale("log", base=2)
    if seen:  # nothing completed: no latencies, and a log axis would refuse the empty plot
        b.set_yscale("log")
    b.set_xlabel("concurrent requests")
    b.set_ylabel("ms")
    b.set_title("latency (speculative)")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
