#!/usr/bin/env bash
# Session 21 (AVX2-only AMD EPYC, `--dtype auto` = float32): served S2D vs served AR through the same app
# (`--compare-plain`), levels 1 and 8, 24 Spec-Bench prompts, 64 tokens, deployments/local.yaml of each checkout:
# base = a worktree at 676eb26 (stock kernels, their fp32 grid), new = HEAD (several-row projections on packed
# weights, the grid measured under them). Run alone, under /work/notes/quiet.sh.
OUT=${OUT:-/work/main/bench_results/serve-s21/ab}
mkdir -p $OUT
n=0
for v in ${ORDER:-base new}; do
  n=$((n+1)); d=/work/main; [[ $v == base ]] && d=/work/base
  echo "$n $v $(date -u +%T)" >> $OUT/runs.txt
  S2D_CHECKOUT=$d LEVELS=${LEVELS:-1,8} bash /work/main/bench_results/serve-s8/ab/ab8.sh $OUT/$n-$v $d/deployments/local.yaml
done
echo all done $(date -u +%T) >> $OUT/runs.txt
