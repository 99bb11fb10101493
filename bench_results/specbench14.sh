#!/usr/bin/env bash
# Spec-Bench in-process, both targets side by side (one core each), then instruct on both cores. Run under quiet.sh.
cd /work/main
M=hf-generate,hf-generate:float32,ar,hf-prompt-lookup,lookup,s2d
for T in smollm2-135m-instruct smollm2-135m-gsm8k; do
  c=$([ $T = smollm2-135m-instruct ] && echo 0 || echo 1)
  taskset -c $c .venv/bin/s2d bench spec --target $T --dtype bfloat16 --threads 1 --per-category 4 \
    --max-new-tokens 128 --methods $M --no-progress --out bench_results/spec-s14-$T > bench_results/spec-s14-$T.log 2>&1 &
done
wait
.venv/bin/s2d bench spec --target smollm2-135m-instruct --dtype bfloat16 --threads 2 --per-category 2 \
  --max-new-tokens 128 --methods hf-generate,hf-prompt-lookup,lookup,s2d --no-progress \
  --out bench_results/spec-s14-instruct-2threads > bench_results/spec-s14-instruct-2threads.log 2>&1
