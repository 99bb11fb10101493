# Run from the repository root after the training runs (reads runs/stage{1,3,4}/metrics.jsonl).
"""Agreement (on-path, per exit) against labelled training tokens for stage 1 -> 3 and the stage-4 experiment."""
import json
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

def rows(path):
    return [json.loads(l) for l in open(path) if l.strip()]

s1, s3 = rows("runs/stage1/metrics.jsonl"), rows("runs/stage3/metrics.jsonl")
try:
    s4 = rows("runs/stage4/metrics.jsonl")
except FileNotFoundError:
    s4 = []
off = s1[-1]["tokens"]
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
colors = {"2": "tab:blue", "4": "tab:orange", "6": "tab:green"}
for e, c in colors.items():
    xs = [r["tokens"] for r in s1] + [off + r["tokens"] for r in s3[1:]]
    ys = [r["on_path"]["agree"][e] for r in s1] + [r["on_path"]["agree"][e] for r in s3[1:]]
    axes[0].plot([x / 1e3 for x in xs], ys, "-o", ms=3, color=c, label=f"exit {e}, stage 3 (instruction text)")
    if s4:
        axes[0].plot([(off + r["tokens"]) / 1e3 for r in s4], [r["on_path"]["agree"][e] for r in s4], "--s", ms=3,
                     color=c, alpha=0.6, label=f"exit {e}, stage 4 (self-distilled)")
axes[0].axvline(off / 1e3, color="grey", lw=0.8)
axes[0].text(off / 1e3, 0.05, " stage 1 | stages 3, 4", fontsize=8)
axes[0].set(xlabel="labelled training tokens (thousands)", ylabel="agreement with the target's greedy token",
            title="on the target's own greedy path (held out)", ylim=(0, 0.5))
axes[0].legend(fontsize=7)
xs = [r["tokens"] for r in s1] + [off + r["tokens"] for r in s3[1:]]
axes[1].plot([x / 1e3 for x in xs], [r["on_path"]["s2d_mat_k5"] for r in s1] + [r["on_path"]["s2d_mat_k5"] for r in s3[1:]],
             "-o", ms=3, color="k", label="S2D, stage 3 (instruction text)")
if s4:
    axes[1].plot([(off + r["tokens"]) / 1e3 for r in s4], [r["on_path"]["s2d_mat_k5"] for r in s4], "--s", ms=3,
                 color="tab:red", label="S2D, stage 4 (self-distilled)")
axes[1].set(xlabel="labelled training tokens (thousands)", ylabel="simulated mean accepted tokens (k = 5)",
            title="tokens per target forward", ylim=(1, 2))
axes[1].legend(fontsize=7)
fig.tight_layout()
fig.savefig("docs/img/agreement_curve.png", dpi=110)
print("wrote docs/img/agreement_curve.png")
