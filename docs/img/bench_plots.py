# Run from the repository root: python docs/img/bench_plots.py
"""The two BENCHMARKS.md plots drawn from committed data: the reference CPU's verify grid (the committed bf16
calibration profile) and the H200's engine rounds (bench_results/gpu-rounds/gpu_check.json)."""
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PROFILE = "s2d_ray/assets/drafts/smollm2-135m-s2d/calibration/smollm2-135m-instruct.bfloat16.json"
GPU = "bench_results/gpu-rounds/gpu_check.json"


def verify_grid() -> None:
    profile = json.load(open(PROFILE))
    grid = profile["costs_ms"]["verify_grid"]
    step = grid["1"]["1"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for batch, row in grid.items():
        ns = [int(n) for n in row]
        ax.plot(ns, [row[n] / step for n in row], "-o", ms=3, label=f"{batch} row(s)")
    ax.set(xscale="log", yscale="log", xlabel="positions per row (k + 1)", ylabel="cost / one-row decode step",
           title=f"verify cost, {profile['costs_measured']['machine']}, bf16, 1 thread")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig("docs/img/verify_grid.png", dpi=110)


def gpu_rounds() -> None:
    engine = json.load(open(GPU))["engine"]
    modes = ["ar", "s2d", "tree"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, batch in zip(axes, ("1", "8")):
        eager = [engine[batch][m]["ms_per_round"] for m in modes]
        graphs = [engine[batch][f"{m}+graphs"]["ms_per_round"] for m in modes]
        xs = range(len(modes))
        ax.bar([x - 0.2 for x in xs], eager, 0.4, label="eager")
        ax.bar([x + 0.2 for x in xs], graphs, 0.4, label="CUDA graphs")
        ax.set(xticks=list(xs), xticklabels=modes, ylabel="ms per round", title=f"7B shape, batch {batch}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig("docs/img/gpu_rounds.png", dpi=110)


verify_grid()
gpu_rounds()
print("wrote docs/img/verify_grid.png, docs/img/gpu_rounds.png")
