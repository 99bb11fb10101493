#!/usr/bin/env bash
# Issue 16, session 21: "S2D with adaptive exits is faster than every single fixed exit on Spec-Bench", measured with
# the stage-6 draft at step 10,000 and its calibration on this host (bench_results/exits-s21/step10000/<target>.json:
# fp32, this AVX2 host's cost grid; thresholds chosen by the search). Every draft method on the same chain under the
# same draft-length policy (the engine's heuristic from k=3, what calibration found best for each exit alone), so the
# rows differ only in where a token leaves the draft: exit 2, 4 or 6 always, or the adaptive exits. Both targets side
# by side (one core each), 1 thread, 2 questions a category, 128 tokens, methods interleaved per question.
# Run alone: /work/notes/quiet.sh 2400 bash bench_results/exits-s21/spec.sh
cd /work/main
OUT=bench_results/exits-s21/spec
draft=${FINAL:-data/draftq/drafts/stage5}
shape=chain+heuristic+k3
M=hf-generate,ar,exit:2:$shape,exit:4:$shape,exit:6:$shape,s2d:$shape
for t in smollm2-135m-instruct smollm2-135m-gsm8k; do
  c=$([[ $t == smollm2-135m-instruct ]] && echo 0 || echo 1)
  taskset -c $c .venv/bin/python -m s2d_ray.cli bench spec --target $t --draft $draft \
    --calibration bench_results/exits-s21/step10000/$t.json --dtype float32 --threads 1 --per-category 2 \
    --max-new-tokens 128 --methods $M --no-progress --out $OUT/$t > $OUT-$t.log 2>&1 &
done
wait
