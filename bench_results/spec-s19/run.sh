#!/usr/bin/env bash
# Session 19, an AMD EPYC with AVX2 only (as session 18: `--dtype auto` resolves to float32). In-process Spec-Bench,
# both targets side by side (one core each), 1 thread, 2 questions a category, 128 tokens, methods interleaved per
# question; the committed draft and profiles. Run under /work/notes/quiet.sh (the stage-6 training paused).
#   TAG: the output directories' name (base: HEAD before a change; ngram: lookup valued by matched suffix length)
cd /work/main
OUT=bench_results/spec-s19
M=hf-generate,ar,hf-prompt-lookup,lookup,s2d
core() { [[ $1 == smollm2-135m-instruct ]] && echo 0 || echo 1; }
for t in smollm2-135m-instruct smollm2-135m-gsm8k; do
  taskset -c $(core $t) .venv/bin/s2d bench spec --target $t --dtype float32 --threads 1 --per-category 2 \
    --max-new-tokens 128 --methods $M --no-progress --out $OUT/${TAG:?}-$t > $OUT/$TAG-$t.log 2>&1 &
done
wait
