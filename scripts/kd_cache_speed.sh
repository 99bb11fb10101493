#!/usr/bin/env bash
# Labelled training tokens/s of SoFT+KD with the targets' forward every step ("before") and from the top-k KD cache
# ("after"), same data, draft and flags; the cache's one-off build time is logged by the cached run.
# usage: /work/notes/quiet.sh 900 scripts/kd_cache_speed.sh OUT_DIR   (results: OUT_DIR/*.json, OUT_DIR/*.log)
set -euo pipefail
out=${1:?OUT_DIR}
rm -rf "$out" && mkdir -p "$out"
py=${PYTHON:-/work/main/.venv/bin/python}
common=(--target smollm2-135m-instruct --layers 6 --exits 2,4,6 --vocab-size 8192 --kd-weight 1.0 --train-norm-head
        --seq-len 256 --batch-size 2 --lr 5e-4 --val-every 100000 --ckpt-every 100000 --val-examples 1
        --limit-examples 200 --seed 3 --threads 1 --no-progress)
one=(--kd-target smollm2-135m-instruct)
two=(--kd-target smollm2-135m-instruct smollm2-135m-gsm8k)
run() {  # name steps args...
  local name=$1 steps=$2; shift 2
  local t0=$SECONDS
  "$py" -m s2d_ray.cli -v train-draft --out "$out/$name" --steps "$steps" "${common[@]}" "$@" \
    > "$out/$name.json" 2> "$out/$name.log"
  echo "$name: $(( SECONDS - t0 )) s total; $("$py" -c "import json,sys; r=json.load(open(sys.argv[1])); \
print(f\"{r['train_tokens']} labelled tokens in {r['wall_s']} s of step time = {r['train_tokens']/r['wall_s']:.0f} tok/s\")" "$out/$name.json")"
}
run dense_1target 20 "${one[@]}"
run dense_2targets 15 "${two[@]}"
run cached_2targets 40 "${two[@]}" --kd-cache "$out/cache" --kd-topk 32   # builds both targets' caches first
grep -h "KD cache for" "$out/cached_2targets.log" || true
run cached_1target 40 "${one[@]}" --kd-cache "$out/cache" --kd-topk 32
du -sh "$out/cache"/*
