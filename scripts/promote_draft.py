"""Make a trained draft the committed default, keeping what was measured about the product around it.

    python scripts/promote_draft.py RUN_DRAFT CAL_DIR [--dest s2d_ray/assets/drafts/smollm2-135m-s2d] [--note TEXT]

RUN_DRAFT is what `s2d train-draft --save` wrote (draft.safetensors, s2d_draft.json, MANIFEST.json); CAL_DIR holds
its calibration per target and dtype (`s2d calibrate ... --costs-from <the committed profile>`, named as
`--calibration auto` looks them up: <target>[.<dtype>].json). Why not just copy both: a draft trained from the
committed one (`--init`) continues its history, so the new MANIFEST chains the old one's stages; and a committed
profile carries more than a calibration run writes (every machine's cost grid, the tree shape and policy chosen on
Spec-Bench), so only the draft-dependent measurements are replaced (acceptance along the held-out paths, top-k hit
rates, the modelled speedups, the chain search's best) and the product settings are kept as they were.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

MEASURED = ("on_path", "top5", "paper_defaults_modelled", "fixed_exits_modelled", "calibration_set")
SETTINGS = ("thresholds", "policy", "k")


def chained_manifest(new: dict, old: dict, note: str) -> dict:
    """The new run's MANIFEST with the committed draft's stages (and that draft's own last run) before it."""
    stages = list(old.get("stages", []))
    if "command" in old:
        stages.append({"stage": f"the committed draft's last run ({old.get('steps')} steps)", "command": old["command"],
                       "steps": old.get("steps"), "train_tokens": old.get("train_tokens"), "wall_s": old.get("wall_s"),
                       "data_sha256_16": old.get("data_sha256_16")})
    stages.append({"stage": "this draft", "command": new["command"], "steps": new["steps"],
                   "train_tokens": new["train_tokens"], "wall_s": new["wall_s"],
                   "data_sha256_16": new["data_sha256_16"], "note": note})
    before = old.get("train_tokens_total", old.get("train_tokens", 0))
    before_s = old.get("wall_s_total", old.get("wall_s", 0.0))
    return {**new, "stages": stages, "train_tokens_total": before + new["train_tokens"],
            "wall_s_total": round(before_s + new["wall_s"], 1)}


def refreshed_profile(committed: dict, measured: dict) -> dict:
    """The committed profile with the new draft's measurements; its settings, tree shape and costs unchanged."""
    out = dict(committed)
    for key in MEASURED:
        if key in measured:
            out[key] = measured[key]
    # The product's thresholds decide which chain the top-level "modelled" describes: the first exit always when
    # they are all 0 (what the committed profiles run), else the search's best.
    first = str(committed["exit_layers"][0])
    always_first = all(t == 0 for t in committed["thresholds"][:-1])
    fixed = measured.get("fixed_exits_modelled", {})
    out["modelled"] = ({"speedup": fixed[first]["speedup"], "mat": fixed[first]["mat"]}
                       if always_first and first in fixed else measured["modelled"])
    tree = dict(out.get("tree_settings", {}))
    tree["chain_settings_from_acceptance_search"] = {**{k: measured[k] for k in SETTINGS},
                                                    "modelled": measured["modelled"]}
    out["tree_settings"] = tree
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("draft", type=Path)
    p.add_argument("calibration", type=Path)
    p.add_argument("--dest", type=Path, default=Path("s2d_ray/assets/drafts/smollm2-135m-s2d"))
    p.add_argument("--note", default="")
    args = p.parse_args()
    new_manifest = json.loads((args.draft / "MANIFEST.json").read_text())
    old_manifest = json.loads((args.dest / "MANIFEST.json").read_text())
    profiles = sorted((args.dest / "calibration").glob("*.json"))
    missing = [f.name for f in profiles if not (args.calibration / f.name).is_file()]
    if missing:
        raise SystemExit(f"{args.calibration} lacks calibrations for {', '.join(missing)}")
    for name in ("draft.safetensors", "s2d_draft.json"):
        shutil.copyfile(args.draft / name, args.dest / name)
    merged = chained_manifest(new_manifest, old_manifest, args.note)
    (args.dest / "MANIFEST.json").write_text(json.dumps(merged, indent=2))
    for path in profiles:
        profile = refreshed_profile(json.loads(path.read_text()), json.loads((args.calibration / path.name).read_text()))
        path.write_text(json.dumps(profile, indent=2))
        print(f"{path}: modelled {profile['modelled']}, search {profile['tree_settings']['chain_settings_from_acceptance_search']}")
    print(f"{args.dest}: {merged['train_tokens_total']:,} labelled tokens over {len(merged['stages'])} stages")


if __name__ == "__main__":
    main()
