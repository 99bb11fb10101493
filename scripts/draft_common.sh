# Sourced by scripts/draft_scale.sh and scripts/draft_exits.sh (from the repository root, with `run` set to RUN_DIR):
# the CLI, the targets and the recipe's flags that fix the packed rows, their order and the KD cache, so that every
# draft trained on RUN_DIR sees exactly the same rows (a KD cache built for other settings is refused).
py=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
threads=${THREADS:-1}
read -r -a targets <<< "${TARGETS:-smollm2-135m-instruct smollm2-135m-gsm8k}"
s2d() { PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$py" -m s2d_ray.cli -v "$@"; }
paths=(); for t in "${targets[@]}"; do paths+=("$run/heldout/$(basename "$t").jsonl"); done
autocast=(); [[ -n ${AUTOCAST-auto} ]] && autocast=(--autocast "${AUTOCAST-auto}")
recipe=(--target "${targets[0]}" --data "$run/sd-multi" --vocab-size 8192 --kd-target "${targets[@]}" --kd-weight 1.0
        --train-norm-head --kd-cache "$run/kdcache" --kd-cache-dtype "${KD_CACHE_DTYPE:-auto}" --kd-topk 32
        --seq-len 256 --batch-size 2 --lr "${LR:-3e-4}" "${autocast[@]}" --val-examples 47 --seed 5 --threads "$threads"
        --no-progress --device "${DEVICE:-auto}" --onpath-data "${paths[@]}")

# profile DRAFT TARGET DTYPE: where the draft's calibration for that target and dtype lives (as --calibration auto
# looks it up); calibrate DRAFT TARGET DTYPE: measure it there, on the target's held-out paths.
profile() { echo "$1/calibration/$(basename "$2")$([[ $3 == float32 ]] || echo ".$3").json"; }
calibrate() {
  mkdir -p "$1/calibration"
  s2d calibrate --target "$2" --draft "$1" --paths "$run/heldout/$(basename "$2").jsonl" --dtype "$3" \
    --calibration off --out "$(profile "$@")" --threads "$threads"
}
