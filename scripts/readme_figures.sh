#!/usr/bin/env bash
# Regenerate every CPU figure of the README's table at ONE commit, one benchmark at a time (nothing else may run on
# the machine meanwhile: each figure is a ratio measured side by side, and a neighbour moves it).
#
#   S2D_DATA_DIR=/path/to/data scripts/readme_figures.sh [section ...]
#
# Sections, in the README's order: spec-bench floor served prefix suffix mt-bench held-out structured
# deterministic plan-check (default: all). Records go to bench_results/<benchmark>/ as BENCHMARKS.md names them; the
# commit is printed at the start, and bench_results/README-figures.json keeps the commit of each section's figures.
# GPU rows are not produced here (scripts/gpu_check.sh on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${S2D_DATA_DIR:?set S2D_DATA_DIR to the data directory (spec_bench/, fastchat/mt_bench/)}"
S2D=${S2D:-.venv/bin/s2d}
SERVE=${SERVE:-.venv/bin/serve}
URL=http://127.0.0.1:8000
# The store of earlier outputs off: for benchmarks that resend the same prompts, which it would answer from before.
NO_STORE='"suffix": {"enabled": false}'
sections=${*:-spec-bench floor served prefix suffix mt-bench held-out structured deterministic plan-check}
commit=$(git rev-parse --short HEAD)
if ! git diff --quiet HEAD -- s2d_ray deployments; then
  echo "the working tree differs from $commit: commit first, so every figure names one commit" >&2
  exit 2
fi
# Which commit each section's figures come from: the sections run now replace their entries, the others stay.
.venv/bin/python - "$commit" "$(date -u +%F)" $sections <<'EOF'
import json, sys
from pathlib import Path
path = Path("bench_results/README-figures.json")
known = json.loads(path.read_text()) if path.exists() else {}
known = known if all(isinstance(v, dict) for v in known.values()) else {}  # an older one-commit record: start over
known.update({section: {"commit": sys.argv[1], "date": sys.argv[2]} for section in sys.argv[3:]})
path.write_text(json.dumps(known, indent=1) + "\n")
EOF
echo "figures at $commit: $sections" >&2

# Serve deployments/local.yaml with extra `args:` (a JSON object merged in), wait until it runs, run "$@", stop it.
with_app() {
  local overrides=$1; shift
  local config
  config=$(mktemp --suffix=.yaml)
  .venv/bin/python - "$overrides" "$config" <<'EOF'
import json, sys, yaml
cfg = yaml.safe_load(open("deployments/local.yaml"))
for app in cfg["applications"]:
    app.setdefault("args", {}).update(json.loads(sys.argv[1]))
yaml.safe_dump(cfg, open(sys.argv[2], "w"))
EOF
  "$SERVE" run "$config" > "bench_results/.serve.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 180); do
    curl -sf "$URL/health" > /dev/null 2>&1 && break
    sleep 5
  done
  "$@" || { kill "$pid"; wait "$pid" || true; rm -f "$config"; return 1; }
  kill "$pid"; wait "$pid" || true
  .venv/bin/ray stop --force > /dev/null 2>&1 || true
  rm -f "$config"
}

for section in $sections; do
  echo "== $section" >&2
  case $section in
    spec-bench)  # §1: both targets side by side, one core each
      for t in smollm2-135m-instruct smollm2-135m-gsm8k; do
        taskset -c "$([ $t = smollm2-135m-instruct ] && echo 0 || echo 1)" "$S2D" bench spec --target $t \
          --dtype auto --threads 1 --per-category 2 --max-new-tokens 128 \
          --methods hf-generate,hf-generate:float32,ar,hf-prompt-lookup,lookup,s2d \
          --questions "$S2D_DATA_DIR/spec_bench/question.jsonl" --no-progress --out bench_results/spec-bench/$t &
      done; wait ;;
    floor)  # §10: held-out chats, all cores, alone and beside a busy core
      "$S2D" bench spec --target smollm2-135m-instruct --questions data/draftq/heldout/smollm2-135m-instruct.jsonl \
        --per-category 6 --max-new-tokens 96 --methods hf-generate,hf-generate:float32,ar,hf-prompt-lookup,s2d \
        --busy-neighbour --no-progress --out bench_results/floor ;;
    served)  # §3: S2D against plain decoding in one app, by concurrency; the store of earlier outputs off, since
      # every level sends the same prompts again and S2D would answer them from the level before. Two runs, a fresh app
      # each: a level's ratio moves by several percent from run to run.
      for run in 1 2; do
        with_app "{$NO_STORE}" "$S2D" bench serve --url $URL --model smollm2-135m-instruct \
          --concurrency 1,2,4,8,16,32,64 --requests 64 --max-seconds 50 --max-tokens 48 --compare-plain \
          --questions "$S2D_DATA_DIR/spec_bench/question.jsonl" --out bench_results/served-sweep/run-$run
      done ;;
    prefix)  # §9: shared prompt and repeated chats, with and without the prefix cache
      for variant in cache nocache; do
        overrides="{$NO_STORE}"  # the prefix cache alone
        [ $variant = nocache ] && overrides="{$NO_STORE, \"prefix_cache\": {\"enabled\": false}}"
        with_app "$overrides" bash -c "
          '$S2D' bench serve --url $URL --model smollm2-135m-instruct --workload shared-prefix --concurrency 1,8 \
            --requests 24 --max-tokens 64 --max-seconds 120 --temperature 0 \
            --out bench_results/prefix-cache/$variant-shared-prefix &&
          '$S2D' bench serve --url $URL --model smollm2-135m-instruct --workload repeated --concurrency 1,8 \
            --requests 96 --max-tokens 64 --max-seconds 120 --temperature 0 \
            --out bench_results/prefix-cache/$variant-repeated"
      done ;;
    suffix)  # §9: drafting from earlier outputs, a fresh app per row (the store outlives a level)
      for store in off on; do
        overrides="{\"suffix\": {\"enabled\": $([ $store = on ] && echo true || echo false), \"max_tokens\": 65536}}"
        for c in 1 8; do
          with_app "$overrides" "$S2D" bench serve --url $URL --model smollm2-135m-instruct --workload repeated \
            --concurrency $c --requests 48 --max-tokens 96 --max-seconds 600 \
            --questions "$S2D_DATA_DIR/spec_bench/question.jsonl" --out bench_results/suffix/$store-c$c
        done
        with_app "$overrides" "$S2D" bench serve --url $URL --model smollm2-135m-instruct --workload mixed \
          --concurrency 1 --requests 48 --max-tokens 96 --max-seconds 600 \
          --questions "$S2D_DATA_DIR/spec_bench/question.jsonl" --out bench_results/suffix/mixed-$store
      done ;;
    mt-bench)  # §9: turn-2 time to first token, two runs; the store off: level 8 resends level 1's chats
      for run in 1 2; do for variant in cache nocache; do
        overrides="{$NO_STORE}"
        [ $variant = nocache ] && overrides="{$NO_STORE, \"prefix_cache\": {\"enabled\": false}}"
        with_app "$overrides" "$S2D" bench serve --url $URL --model smollm2-135m-instruct --workload mt-bench \
          --concurrency 1,8 --requests 16 --max-tokens 64 --max-seconds 240 \
          --out bench_results/mt-bench/run-$run/$variant
      done; done ;;
    held-out)  # §2: the draft's agreement along the targets' greedy paths, modelled speed
      for t in smollm2-135m-instruct smollm2-135m-gsm8k; do
        "$S2D" calibrate --target $t --draft smollm2-135m-s2d --paths data/draftq/heldout/$t.jsonl --dtype bfloat16 \
          --calibration off --costs-from s2d_ray/assets/drafts/smollm2-135m-s2d/calibration/$t.bfloat16.json \
          --threads 1 --out bench_results/held-out/calibration/$t.bfloat16.json
      done ;;
    structured)  # §8: JSON under a schema
      "$S2D" bench structured --max-new-tokens 256 --threads 1 --out bench_results/structured/bfloat16.json
      "$S2D" bench structured --max-new-tokens 256 --threads 1 --dtype float32 \
        --out bench_results/structured/float32.json ;;
    deterministic)  # §11
      scripts/deterministic_check.sh bench_results/deterministic 128 2 ;;
    plan-check)  # §7: the fleet model against the engine
      "$S2D" bench plan-check --out bench_results/plan-check/cpu ;;
    *) echo "unknown section $section" >&2; exit 2 ;;
  esac
done
echo "done at $commit; update README.md's table and BENCHMARKS.md from bench_results/" >&2
