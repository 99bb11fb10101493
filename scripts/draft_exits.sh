#!/usr/bin/env bash
# Exit layouts and loss weightings compared: variants of the sorted draft, each trained STEPS steps from the same start
# on the same rows (the same KD cache), then calibrated for every target: agreement and top-4 per exit, cost per exit
# token, and the modelled speed of the adaptive draft, in one table (RUN_DIR/exits/summary.md). Run it after
# scripts/draft_scale.sh (it reuses that RUN_DIR's data, held-out paths and KD cache), on an otherwise idle machine:
# calibration times things.
#   scripts/draft_exits.sh RUN_DIR [VARIANT...]     (default: base weights distill deep)
# Variants: base     LAYERS (6) layers, EXITS (2,4,6), equal loss weights (the recipe as it is: the control)
#           weights  the same with loss weights WEIGHTS (0.5,1,2: the deep exit first)
#           distill  the same with --exit-distill 0.5 (shallow exits also learn from the detached deepest one)
#           deep     DEEP_LAYERS (9) layers, DEEP_EXITS (3,6,9), grown from INIT (its trained layers, then the
#                    target's next ones)
# Environment: INIT (RUN_DIR/draft when it exists, else the committed draft), STEPS (1000), LR (3e-4, the recipe's
# peak; 3e-5 continues a finished draft at its final rate), OUT (RUN_DIR/exits: one folder per STEPS/LR setting),
# CAL_DTYPE (bfloat16), and PYTHON, THREADS, TARGETS, DEVICE, AUTOCAST as in draft_scale.sh. Every step resumes.
# Dry run with tiny random targets: docs/TRAINING.md.
set -euo pipefail
cd "$(dirname "$0")/.."
run=${1:?RUN_DIR}; shift
variants=("$@"); [[ ${#variants[@]} -gt 0 ]] || variants=(base weights distill deep)
source scripts/draft_common.sh
init=${INIT:-}; [[ -z $init && -f $run/draft/MANIFEST.json ]] && init=$run/draft
init=${init:-s2d_ray/assets/drafts/smollm2-135m-s2d}
steps=${STEPS:-1000}
for v in "${variants[@]}"; do
  case $v in
    base) shape=(--layers "${LAYERS:-6}" --exits "${EXITS:-2,4,6}") ;;
    weights) shape=(--layers "${LAYERS:-6}" --exits "${EXITS:-2,4,6}" --exit-weights "${WEIGHTS:-0.5,1,2}") ;;
    distill) shape=(--layers "${LAYERS:-6}" --exits "${EXITS:-2,4,6}" --exit-distill 0.5) ;;
    deep) shape=(--layers "${DEEP_LAYERS:-9}" --exits "${DEEP_EXITS:-3,6,9}") ;;
    *) echo "unknown variant $v (base, weights, distill, deep)" >&2; exit 2 ;;
  esac
  out=${OUT:-$run/exits}/$v
  if [[ ! -f $out/draft/MANIFEST.json ]]; then
    resume=(); [[ -f $out/run/checkpoint.pt ]] && resume=(--resume)
    s2d train-draft "${recipe[@]}" --out "$out/run" --save "$out/draft" --init "$init" "${shape[@]}" \
      --steps "$steps" --warmup 0.05 --val-every "$steps" --ckpt-every 50 "${resume[@]}"
  fi
  for t in "${targets[@]}"; do
    [[ -f $(profile "$out/draft" "$t" "${CAL_DTYPE:-bfloat16}") ]] || calibrate "$out/draft" "$t" "${CAL_DTYPE:-bfloat16}"
  done
done
"$py" - "${OUT:-$run/exits}" "${CAL_DTYPE:-bfloat16}" "${variants[@]}" <<'EOF'
import json, sys
from pathlib import Path
root, dtype, variants = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
sfx = "" if dtype == "float32" else f".{dtype}"
lines = ["| variant | target | top-1 per exit | top-4 per exit | ms per draft token per exit | adaptive: modelled "
         "speedup (MAT) | each exit alone: modelled speedup |", "|---|---|---|---|---|---|---|"]
for v in variants:
    manifest = json.loads((root / v / "draft" / "MANIFEST.json").read_text())
    for name, m in manifest["final_metrics"]["on_path_by_file"].items():
        profile = json.loads((root / v / "draft" / "calibration" / f"{name}{sfx}.json").read_text())
        exits = list(m["agree"])
        top1 = " / ".join(f"{m['agree'][e]:.3f}" for e in exits)
        top4 = " / ".join(f"{m['topk_hit'][e][3]:.3f}" for e in exits)
        cost = " / ".join(f"{c:.2f}" for c in profile["costs_ms"]["exit_token"])
        mod = profile["modelled"]
        alone = " / ".join(f"{a['speedup']:.3f}" for a in profile.get("fixed_exits_modelled", {}).values())
        lines.append(f"| {v} (exits {', '.join(exits)}) | {name} | {top1} | {top4} | {cost} | "
                     f"{mod['speedup']:.3f} ({mod['mat']:.2f}) | {alone} |")
(root / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
