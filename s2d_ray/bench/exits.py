"""When a sorted draft's deeper exits pay: each exit alone (its layers and one head, at its best draft length k),
modelled from the exit's measured agreement with the target and a machine's costs, beside the other exits.

A deeper exit agrees more often but every draft token through it costs more layers; it pays where the agreement it
adds is worth more than those layers against the target's verification. So the answer is per target (agreement),
per machine (the draft-to-target cost ratio) and per dtype, and for each exit this reports the agreement it would
need to tie the best exit on that machine: how much a better draft (more labelled tokens) must add before the
adaptive exits, the paper's mechanism, have anything to choose.

CPU rows use the committed calibration profiles: each machine's measured costs (`costs_ms`, `costs_by_machine`)
and on-path agreement per exit (held-out greedy paths). GPU rows use the fleet model (fleet/model.py) for a Serve
YAML's targets and draft on a device from fleet/hardware.py, with the committed draft's per-exit agreement taken
for the exits of the same rank (shallowest, ..., deepest): no GPU family draft's agreement is measured yet.
Speed is MAT(a, k) x verify(1) / (k x draft token + verify(k + 1)), MAT(a, k) = (1 - a^(k+1)) / (1 - a) at batch 1.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ..fleet.hardware import Device
from ..fleet.model import Replica, mat

PROFILES = Path(__file__).parents[1] / "assets" / "drafts" / "smollm2-135m-s2d" / "calibration"
MAX_K = 12


def best_k(agree: float, draft_ms: float, verify_ms: Callable[[int], float], max_k: int = MAX_K) -> tuple[int, float]:
    """(k, speed-up over plain decoding) of the best draft length at this agreement and draft-token cost."""
    speeds = [(mat(agree, k) * verify_ms(1) / (k * draft_ms + verify_ms(k + 1)), -k) for k in range(1, max_k + 1)]
    speed, neg_k = max(speeds)
    return -neg_k, speed


def agreement_to_reach(speed: float, draft_ms: float, verify_ms: Callable[[int], float]) -> float | None:
    """The smallest agreement at which an exit with this draft-token cost reaches `speed` (None: not below 0.999)."""
    if best_k(0.999, draft_ms, verify_ms)[1] < speed:
        return None
    lo, hi = 0.0, 0.999
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if best_k(mid, draft_ms, verify_ms)[1] >= speed else (mid, hi)
    return hi


def exit_rows(agree: list[float], draft_ms: list[float], verify_ms: Callable[[int], float]) -> list[dict]:
    """One row per exit: its agreement, best k, speed-up, whether it is the best exit, and the agreement it would
    need to tie the best one."""
    rows = [dict(zip(("k", "speedup"), best_k(a, d, verify_ms))) for a, d in zip(agree, draft_ms)]
    top = max(r["speedup"] for r in rows)
    for r, a, d in zip(rows, agree, draft_ms):
        need = agreement_to_reach(top, d, verify_ms)
        r.update(agree=round(a, 4), speedup=round(r["speedup"], 4), best=r["speedup"] == top,
                 draft_to_verify=round(d / verify_ms(1), 4), agree_to_tie=None if need is None else round(need, 4))
    return rows


def cpu_tables(profiles: Path = PROFILES) -> list[dict]:
    """Every committed profile (target x dtype) on every machine whose costs it carries."""
    from ..hardware import costs_machine
    from ..train.calibrate import Costs

    out = []
    for path in sorted(profiles.glob("*.json")):
        p = json.loads(path.read_text())
        layers = p["exit_layers"]
        agree = [p["on_path"]["agree"][str(e)] for e in layers]
        machines = {costs_machine(p) or "unrecorded": p["costs_ms"]}
        machines.update({m: e["costs_ms"] for m, e in (p.get("costs_by_machine") or {}).items()})
        for machine, costs_ms in machines.items():
            costs = Costs.from_profile(costs_ms)
            rows = exit_rows(agree, [1e3 * c for c in costs.exit_token], lambda n: 1e3 * costs.verify_n(n))
            out.append({"machine": machine, "target": p["target"], "dtype": p["dtype"],
                        "exits": [{"layer": e, **r} for e, r in zip(layers, rows)]})
    return out


def gpu_tables(config: Path, dev: Device, profile: Path, context: int = 512) -> list[dict]:
    """The fleet model's targets (a Serve YAML) with its draft's exits on `dev`, at the profile's per-exit agreement
    by exit rank."""
    from ..fleet.plan import draft_shape_of, dtype_bytes, model_shape, read_app_config

    app = read_app_config(config)
    dshape, depth = draft_shape_of(app.draft.source, app.draft.exit_layers)
    layers = sorted(app.draft.exit_layers or [depth])
    p = json.loads(profile.read_text())
    measured = [p["on_path"]["agree"][str(e)] for e in p["exit_layers"]]
    agree = [measured[min(round(i * (len(measured) - 1) / max(len(layers) - 1, 1)), len(measured) - 1)]
             for i in range(len(layers))]
    out = []
    for t in app.targets:
        common = dict(target=model_shape(t.resolved_source), dev=dev, tp=t.tp_size, context=context,
                      dtype_bytes=dtype_bytes(t.dtype, dev))
        base = Replica(**common)
        draft_ms = [Replica(**common, draft=dshape.shard(t.tp_size), draft_depth=e).draft_ms(1) for e in layers]
        # verifying n positions: a round of n - 1 drafts without their drafting (a draft-less replica drafts for
        # free), so the engine's round and a speculative round's overheads count alike for every exit
        rows = exit_rows(agree, draft_ms, lambda n, base=base: base.round_ms(1, n - 1))
        out.append({"machine": f"{dev.name} (fleet model)", "target": t.name, "dtype": t.dtype,
                    "exits": [{"layer": e, **r} for e, r in zip(layers, rows)]})
    return out


def markdown(tables: list[dict]) -> str:
    lines = ["| machine | target | dtype | exit | agreement | draft token / target step | best k | speed-up | "
             "agreement to tie the best |", "|---|---|---|---|---|---|---|---|---|"]
    for t in tables:
        for e in t["exits"]:
            tie = "best" if e["best"] else ("unreachable" if e["agree_to_tie"] is None else f"{e['agree_to_tie']:.3f}")
            lines.append(f"| {t['machine']} | {t['target']} | {t['dtype']} | {e['layer']} | {e['agree']:.3f} | "
                         f"{e['draft_to_verify']:.3f} | {e['k']} | {e['speedup']:.3f} | {tie} |")
    return "\n".join(lines) + "\n"
