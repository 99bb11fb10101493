# Run from the repository root: python docs/img/stage6_curve.py [MANIFEST.json] (default: the committed draft, stage 6
# since session 21, whose MANIFEST carries the whole validation curve across machines).
"""Stage 6 (issue 16): held-out on-path agreement per exit and top-4 at the deepest exit, per target, against
labelled training tokens, with the issue's goals drawn in."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

path = sys.argv[1] if len(sys.argv) > 1 else "s2d_ray/assets/drafts/smollm2-135m-s2d/MANIFEST.json"
curve = json.load(open(path))["curve"]
targets = {"smollm2-135m-instruct": ("instruct target", 0.60), "smollm2-135m-gsm8k": ("GSM8K target", 0.55)}
fig, axes = plt.subplots(1, len(targets), figsize=(11, 4), sharey=True)
xs = [r["tokens"] / 1e3 for r in curve]
for ax, (name, (label, goal)) in zip(axes, targets.items()):
    by_exit = curve[-1]["on_path_by_file"][name]["agree"]
    for exit_, color in zip(by_exit, ("tab:blue", "tab:orange", "tab:green")):
        ax.plot(xs, [r["on_path_by_file"][name]["agree"][exit_] for r in curve], "-o", ms=3, color=color,
                label=f"exit {exit_}: top-1")
    deepest = list(by_exit)[-1]
    ax.plot(xs, [r["on_path_by_file"][name]["topk_hit"][deepest][3] for r in curve], "--s", ms=3, color="tab:green",
            alpha=0.6, label=f"exit {deepest}: top-4")
    ax.axhline(goal, color="tab:green", lw=0.8, ls=":")
    ax.text(xs[0], goal + 0.005, f" goal: deepest top-1 >= {goal}", fontsize=7)
    ax.axhline(0.80, color="grey", lw=0.8, ls=":")
    ax.text(xs[0], 0.805, " goal: top-4 >= 0.80", fontsize=7)
    ax.set(title=f"{label}: held-out greedy path", xlabel="labelled training tokens (thousands)", ylim=(0.3, 0.85))
    ax.legend(fontsize=7, loc="lower right")
axes[0].set_ylabel("share of path tokens the draft predicts")
fig.tight_layout()
fig.savefig("docs/img/stage6_curve.png", dpi=110)
print("wrote docs/img/stage6_curve.png")
