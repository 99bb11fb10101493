#!/usr/bin/env bash
# Lookup branches A/B, in-process Spec-Bench: both targets side by side (one core each), bf16, 1 thread; every
# method on the same prompts in one run (order rotated per question). Run under quiet.sh.
cd /work/main
OUT=${OUT:-bench_results/spec-s15}
PER=${PER:-3}
M=${M:-hf-generate,hf-prompt-lookup,lookup,lookup:lc4,s2d,s2d:lc4}
for T in smollm2-135m-instruct smollm2-135m-gsm8k; do
  c=$([ $T = smollm2-135m-instruct ] && echo 0 || echo 1)
  taskset -c $c .venv/bin/s2d bench spec --target $T --dtype ${DTYPE:-bfloat16} --threads 1 --per-category $PER \
    --max-new-tokens 128 --methods $M --no-progress --out $OUT/ab${TAG}-$T > $OUT/ab${TAG}-$T.log 2>&1 &
done
wait
