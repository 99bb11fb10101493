#!/usr/bin/env bash
# Session 20, AMD EPYC with AVX2 only (`--dtype auto` = float32). The A/B of session 19's changes (the CPU attention
# kernel measured at load; lookup valued by match length) and session 20's re-measured AVX2 fp32 cost grid:
#   SRC=/work/base (a worktree at 69c6efe, session 18's last code and its profiles) TAG=base
#   SRC=/work/main (HEAD) TAG=new
# In-process Spec-Bench, both targets side by side (one core each), 1 thread, 2 questions a category, 128 tokens,
# methods interleaved per question; each tree's committed draft and profiles. Run under /work/notes/quiet.sh (the
# stage-6 training paused). Outputs land in OUT (default /work/main/bench_results/spec-s20) whichever SRC ran.
# Session 21 reran it as the A/B of the packed several-row projections (core/linear.py) and the fp32 grid measured
# under them: OUT=/work/main/bench_results/spec-s21 with SRC=<worktree at 676eb26> TAG=base, then SRC=<HEAD> TAG=new.
OUT=${OUT:-/work/main/bench_results/spec-s20}
M=hf-generate,ar,hf-prompt-lookup,lookup,s2d
cd "${SRC:?}"
core() { [[ $1 == smollm2-135m-instruct ]] && echo 0 || echo 1; }
for t in smollm2-135m-instruct smollm2-135m-gsm8k; do
  taskset -c $(core $t) /work/main/.venv/bin/python -m s2d_ray.cli bench spec --target $t --dtype float32 --threads 1 \
    --per-category 2 --max-new-tokens 128 --methods $M --no-progress --out $OUT/${TAG:?}-$t > $OUT/$TAG-$t.log 2>&1 &
done
wait
