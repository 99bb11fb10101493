"""docs/img/fleet.png: tokens/s per target GPU by batch (per fleet) and GPUs needed by request rate."""

from __future__ import annotations

from pathlib import Path

from .hardware import Device
from .model import Replica
from .plan import draft_shape_of, model_shape, plan, read_app_config


def plot_fleet(config: Path, dev: Device, out: Path, agrees: tuple[float, ...] = (0.51, 0.7),
               rates: tuple[float, ...] = (0.5, 1, 2, 4, 8, 16, 32)) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    app = read_app_config(config)
    dshape, depth = draft_shape_of(app.draft.source, app.draft.exit_layers)
    t = app.targets[0]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    batches = [1, 2, 4, 8, 16, 32, 64, 128]
    for a, style in zip(agrees, ("-", "--")):
        rep = Replica(model_shape(t.resolved_source), dev, tp=t.tp_size, draft=dshape, draft_depth=depth, agree=a)
        if a == agrees[0]:
            ax1.plot(batches, [rep.tokens_per_s(b, 0) for b in batches], "k-", label="no speculation")
        for shared, colour, name in ((False, "tab:blue", "own draft"), (True, "tab:orange", "shared draft")):
            ks = [rep.best_k(b, draft_elsewhere=shared) for b in batches]
            ax1.plot(batches, [rep.tokens_per_s(b, k, shared) for b, k in zip(batches, ks)], style, color=colour,
                     label=f"{name}, agreement {a}")
        for fleet, colour in (("none", "k"), ("per_target", "tab:blue"), ("shared", "tab:orange")):
            if fleet == "none" and a != agrees[0]:
                continue
            gpus = [plan(config, dev, r, agree=a)["totals"][fleet]["gpus"] for r in rates]
            ax2.plot(rates, gpus, style, color=colour, marker="o", ms=3,
                     label=f"{fleet}" + ("" if fleet == "none" else f", agreement {a}"))
    ax1.set(xscale="log", xlabel="sequences per forward (batch)", ylabel="tokens/s per target GPU",
            title=f"{t.name} on {dev.name} (best k per batch)")
    ax2.set(xscale="log", yscale="log", xlabel="requests/s per target", ylabel="GPUs (targets + shared draft)",
            title=f"{config.name}: {len(app.targets)} targets on {dev.name}")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
