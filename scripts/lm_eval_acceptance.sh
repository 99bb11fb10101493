#!/usr/bin/env bash
# Issue 12's acceptance run: lm-evaluation-harness against `serve run deployments/local.yaml` (the shipped file,
# unchanged) and the same tasks in-process on the targets (lm-eval's `hf` model, and this project's own target
# decoding alone for the GSM8K prompts), then a per-sample comparison.
#
# usage: scripts/lm_eval_acceptance.sh OUT_DIR [served|inprocess|engine|compare|all]
#   env: GSM8K_LIMIT (24), INPROCESS_DTYPES ("bfloat16 float32"), ENGINE_DTYPE (auto), S2D_DATA_DIR
#        (/work/shared/data), S2D_MODELS (~/.cache/s2d_ray/models: the converted targets, whose tokenizers lm-eval
#        needs), PYTHON, BIN; SERVED_DTYPE: serve a copy of local.yaml with `dtype: <it>` on the draft and every
#        target (a supplementary run: `dtype: auto` is bf16 on CPUs with AVX512-BF16, where greedy equality holds only
#        up to rounding near-ties)
# Run it from a quiet machine (it starts Ray Serve on 127.0.0.1:8000, as local.yaml says).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:?usage: $0 OUT_DIR [served|inprocess|engine|compare|all]}")
WHAT=${2:-all}
BIN=${BIN:-$(dirname "$(command -v lm_eval)")}
PYTHON=${PYTHON:-$BIN/python}
DATA=${S2D_DATA_DIR:-/work/shared/data}
MODELS=${S2D_MODELS:-$HOME/.cache/s2d_ray/models}
LIMIT=${GSM8K_LIMIT:-24}
URL=http://127.0.0.1:8000
TASKS=$OUT/tasks
# served model -> the converted checkpoint it serves (local.yaml's targets)
declare -A SOURCE=([smollm2-135m-gsm8k]=smollm2-135m-gsm8k [smollm2-135m-instruct]=smollm2-135m-instruct
                   [smollm2-135m-instruct-tp3]=smollm2-135m-instruct)
MC_MODELS="smollm2-135m-gsm8k smollm2-135m-instruct smollm2-135m-instruct-tp3"
GEN_MODEL=smollm2-135m-gsm8k

# The GSM8K task file names the data relative to a checkout next to ../shared; resolve it for this checkout.
mkdir -p "$TASKS"
cp docs/lm_eval/mc_local.yaml "$TASKS/"
sed "s#\.\./shared/data#$DATA#" docs/lm_eval/gsm8k_local.yaml > "$TASKS/gsm8k_local.yaml"

timed() {  # timed NAME CMD...: run, record the wall time in $OUT/times.tsv
    local name=$1 t0; shift; t0=$(date +%s)
    "$@"
    echo -e "$name\t$(( $(date +%s) - t0 )) s" >> "$OUT/times.tsv"
}

served() {
    local config=deployments/local.yaml
    if [ -n "${SERVED_DTYPE:-}" ]; then
        config=$OUT/local-$SERVED_DTYPE.yaml
        sed -e "s/^\(      draft:\)$/\1\n        dtype: $SERVED_DTYPE/" \
            -e "s/^\(        - name: .*\)$/\1\n          dtype: $SERVED_DTYPE/" deployments/local.yaml > "$config"
    fi
    "$BIN/serve" run "$config" > "$OUT/serve.log" 2>&1 &
    local pid=$!
    # SIGTERM: a background job of a script ignores SIGINT; serve run shuts its local Ray down on either
    trap "kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null || true" EXIT
    for _ in $(seq 900); do
        curl -sf "$URL/health" > /dev/null && break
        kill -0 $pid 2>/dev/null || { echo "serve run exited; see $OUT/serve.log" >&2; exit 1; }
        sleep 1
    done
    curl -sf "$URL/v1/models" > "$OUT/served-models.json"
    for m in $MC_MODELS; do
        timed "served mc $m" "$BIN/lm_eval" --model local-completions --tasks s2d_mc_local --include_path "$TASKS" \
            --model_args "model=$m,base_url=$URL/v1/completions,tokenizer=$MODELS/${SOURCE[$m]},tokenizer_backend=huggingface,num_concurrent=1" \
            --log_samples --output_path "$OUT/served/$m"
    done
    timed "served gsm8k $GEN_MODEL" "$BIN/lm_eval" --model local-chat-completions --tasks s2d_gsm8k_local \
        --include_path "$TASKS" --apply_chat_template --limit "$LIMIT" \
        --model_args "model=$GEN_MODEL,base_url=$URL/v1/chat/completions,num_concurrent=1,timeout=600" \
        --log_samples --output_path "$OUT/served/$GEN_MODEL"
    curl -sf "$URL/health" > "$OUT/served-health.json"
    curl -sf "$URL/metrics" > "$OUT/served-metrics.txt"
    kill -TERM $pid; wait $pid || true; trap - EXIT
}

inprocess() {
    for dt in ${INPROCESS_DTYPES:-bfloat16 float32}; do
        for src in smollm2-135m-gsm8k smollm2-135m-instruct; do
            timed "hf-$dt mc $src" "$BIN/lm_eval" --model hf --model_args "pretrained=$MODELS/$src,dtype=$dt" \
                --device cpu --batch_size 1 --tasks s2d_mc_local --include_path "$TASKS" \
                --log_samples --output_path "$OUT/hf-$dt/$src"
        done
        timed "hf-$dt gsm8k $GEN_MODEL" "$BIN/lm_eval" --model hf \
            --model_args "pretrained=$MODELS/${SOURCE[$GEN_MODEL]},dtype=$dt" --device cpu --batch_size 1 \
            --tasks s2d_gsm8k_local --include_path "$TASKS" --apply_chat_template --limit "$LIMIT" \
            --log_samples --output_path "$OUT/hf-$dt/$GEN_MODEL"
    done
}

engine() {  # both tasks through this project's own target alone, in-process (the lossless reference)
    local dt=${ENGINE_DTYPE:-auto}
    "$PYTHON" -c "import json, sys
for line in list(open(sys.argv[1]))[:int(sys.argv[2])]:
    print(json.dumps({'prompt': json.loads(line)['question']}))" "$DATA/gsm8k_test_dev/test_dev.jsonl" "$LIMIT" \
        > "$OUT/gsm8k-prompts.jsonl"
    mkdir -p "$OUT/engine-ar"
    timed "engine ar $dt gsm8k $GEN_MODEL" "$PYTHON" -m s2d_ray.cli generate --target "${SOURCE[$GEN_MODEL]}" \
        --mode ar --dtype "$dt" --threads 1 --chat --max-new-tokens 256 --json \
        --prompt-file "$OUT/gsm8k-prompts.jsonl" > "$OUT/engine-ar/$GEN_MODEL.jsonl"
    local pairs=""
    for m in $MC_MODELS; do pairs="$pairs $m=${SOURCE[$m]}"; done
    timed "engine ll $dt mc" "$PYTHON" scripts/lm_eval_engine_ll.py "$OUT" $pairs --dtype "$dt"
}

compare() {
    "$PYTHON" scripts/lm_eval_compare.py "$OUT" | tee "$OUT/compare.md"
}

case $WHAT in
    served) served ;; inprocess) inprocess ;; engine) engine ;; compare) compare ;;
    all) served; inprocess; engine; compare ;;
    *) echo "unknown step $WHAT (served|inprocess|engine|compare|all)" >&2; exit 2 ;;
esac
