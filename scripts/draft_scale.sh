#!/usr/bin/env bash
# The training pipeline of a multi-target sorted draft: both targets' self-distilled responses to the training
# instructions, their held-out paths, then multi-target KD from a top-k logit cache, calibration and Spec-Bench.
# Every step resumes: after any interruption (kill -9 included) rerun the SAME command; finished chunks, cache parts
# and checkpoints are kept. RUN_DIR (absolute, or relative to the repository root) holds everything it writes:
#   sd-multi/ (responses), heldout/ (paths), kdcache/, train/ (checkpoint, metrics.jsonl), draft/ (the trained draft
#   with its calibration/), bench/<target>/ (Spec-Bench), resume/ (an exported draft to continue from).
#
#   scripts/draft_scale.sh RUN_DIR [gen|heldout|train|all]      (default: all, in that order)
#   scripts/draft_scale.sh RUN_DIR finish   after `train`: calibrate RUN_DIR/draft for every target in each of
#     CAL_DTYPES ("bfloat16 float32"; profiles in its calibration/, named as --calibration auto looks them up), then
#     Spec-Bench per target in BENCH_DTYPE (auto: bf16 where it is the fast path), PER_CATEGORY (2) questions a
#     category, 128 tokens: ar, transformers' generate and prompt lookup, then each fixed exit and the adaptive exits
#     under CHAIN_SHAPE (chain+auto) and under TREE_SHAPE (tree4+lookup+auto+n24, what the committed profiles run),
#     side by side (RUN_DIR/bench/<target>): whether the adaptive exits beat every fixed exit; BENCH_ARGS: more
#     `s2d bench spec` flags. It times things: run it on an otherwise idle machine.
#   scripts/draft_scale.sh RUN_DIR export   the latest checkpoint as RUN_DIR/resume (a bf16 draft, ~1/6 of a
#     checkpoint), from which `train` continues on a machine without the checkpoint. The KD cache is built lazily in
#     the order steps visit the rows, so a moved run rebuilds only the part still ahead.
# Environment: PYTHON (default .venv/bin/python if present, else python3), THREADS (1), STEPS (10000: about one epoch
# of the responses to the full instruction file at 2 x 256 per step), GEN_DTYPE (bfloat16), TARGETS
# ("smollm2-135m-instruct smollm2-135m-gsm8k"; the first is the draft's base), INIT (the committed draft; empty:
# none), DATA and NUM (the instruction file, default $S2D_DATA_DIR/train/instructions.jsonl, and how many of its train
# instructions; default all), LAYERS and EXITS (6; 2,4,6), KD_CACHE_DTYPE (auto: bfloat16 where the CPU has native
# bf16, else float32), AUTOCAST (auto: the draft's steps under bf16 autocast where bf16 is the fast path; bfloat16:
# always; empty: float32), DEVICE (auto: cuda when torch sees a GPU), CKPT_EVERY (25), TIME_LIMIT (seconds: `train`
# stops checkpointed and exports; device and checkpoint interval may change on resume), S2D_DATA_DIR.
# Dry run with tiny random models (seconds): see docs/TRAINING.md.
set -euo pipefail
cd "$(dirname "$0")/.."
run=${1:?RUN_DIR}; what=${2:-all}
source scripts/draft_common.sh
init=${INIT-s2d_ray/assets/drafts/smollm2-135m-s2d}
data=(); [[ -n ${DATA:-} ]] && data=(--data "$DATA")
num=(); [[ -n ${NUM:-} ]] && num=(--num "$NUM")
mkdir -p "$run/heldout"
if [[ $what == gen || $what == all ]]; then
  s2d self-distill --target "${targets[@]}" --out "$run/sd-multi" "${data[@]}" "${num[@]}" --batch-size 32 --max-new-tokens 256 \
    --dtype "${GEN_DTYPE:-bfloat16}" --threads "$threads" --seed 7
fi
if [[ $what == heldout || $what == all ]]; then
  for t in "${targets[@]}"; do
    s2d self-distill --target "$t" "${data[@]}" --split heldout --num 48 --max-new-tokens 160 --batch-size 16 \
      --threads "$threads" --out "$run/heldout/$(basename "$t").jsonl"
  done
fi
if [[ $what == train || $what == all || $what == export ]]; then
  # The checkpoint when this machine has it; else the draft a run exported to carry it here (step `export`).
  resume=(); [[ -f $run/train/checkpoint.pt || -f $run/resume/MANIFEST.json ]] && resume=(--resume)
  [[ -f $run/resume/MANIFEST.json ]] && resume+=(--resume-draft "$run/resume")
  from=(); [[ -n $init ]] && from=(--init "$init")
  limit=(); [[ -n ${TIME_LIMIT:-} ]] && limit=(--time-limit "$TIME_LIMIT")
  save=$run/draft; export=()
  [[ $what == export ]] && { save=$run/resume; resume=(); export=(--export-only); }
  s2d train-draft "${recipe[@]}" --out "$run/train" --save "$save" "${from[@]}" --layers "${LAYERS:-6}" \
    --exits "${EXITS:-2,4,6}" --steps "${STEPS:-10000}" --warmup 0.02 --val-every 500 \
    --ckpt-every "${CKPT_EVERY:-25}" "${resume[@]}" "${limit[@]}" "${export[@]}"
fi
if [[ $what == finish ]]; then
  draft=$run/draft
  [[ -f $draft/MANIFEST.json ]] || { echo "no draft in $draft: run train (it saves there when it ends)" >&2; exit 1; }
  for t in "${targets[@]}"; do
    name=$(basename "$t")
    for dt in ${CAL_DTYPES:-bfloat16 float32}; do calibrate "$draft" "$t" "$dt"; done
    # Each exit alone against the adaptive exits under the same shape and policy: chains, and the product's trees
    methods=hf-generate,ar,hf-prompt-lookup; IFS=, read -r -a ex <<< "${EXITS:-2,4,6}"
    for shape in "${CHAIN_SHAPE:-chain+auto}" "${TREE_SHAPE:-tree4+lookup+auto+n24}"; do
      for e in "${ex[@]}"; do methods+=",exit:$e:$shape"; done; methods+=",s2d:$shape"
    done
    s2d bench spec --target "$t" --draft "$draft" --dtype "${BENCH_DTYPE:-auto}" --threads "$threads" \
      --per-category "${PER_CATEGORY:-2}" --max-new-tokens 128 --methods "$methods" --out "$run/bench/$name" \
      ${BENCH_ARGS:-}
  done
fi
