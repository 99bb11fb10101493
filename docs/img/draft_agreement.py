# Run from the repository root: python docs/img/draft_agreement.py [MANIFEST.json] (default: the committed draft,
# whose MANIFEST carries its last stage's validation curve).
"""Held-out on-path agreement per exit and top-4 at the deepest exit, per target, against labelled training
tokens of the committed draft's last training stage."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

path = sys.argv[1] if len(sys.argv) > 1 else "s2d_ray/assets/drafts/smollm2-135m-s2d/MANIFEST.json"
curve = json.load(open(path))["curve"]
targets = {"smollm2-135m-instruct": "instruct target", "smollm2-135m-gsm8k": "GSM8K target"}
fig, axes = plt.subplots(1, len(targets), figsize=(11, 4), sharey=True)
xs = [r["tokens"] / 1e3 for r in curve]
for ax, (name, label) in zip(axes, targets.items()):
    by_exit = curve[-1]["on_path_by_file"][name]["agree"]
    for exit_, color in zip(by_exit, ("tab:blue", "tab:orange", "tab:green")):
        ax.plot(xs, [r["on_path_by_file"][name]["agree"][exit_] for r in curve], "-o", ms=3, color=color,
                label=f"exit {exit_}: top-1")
    deepest = list(by_exit)[-1]
    ax.plot(xs, [r["on_path_by_file"][name]["topk_hit"][deepest][3] for r in curve], "--s", ms=3, color="tab:green",
            alpha=0.6, label=f"exit {deepest}: top-4")
    ax.set(title=f"{label}: held-out greedy path", xlabel="labelled training tokens (thousands)", ylim=(0.3, 0.85))
    ax.legend(fontsize=7, loc="lower right")
axes[0].set_ylabel("share of path tokens the draft predicts")
fig.tight_layout()
fig.savefig("docs/img/draft_agreement.png", dpi=110)
print("wrote docs/img/draft_agreement.png")
