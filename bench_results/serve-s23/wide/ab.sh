#!/usr/bin/env bash
# Session 23: served S2D and served AR (one app, `--compare-plain`) with wide passes on 2 threads (deployments/local.yaml)
# against 1 (wide_threads: 1), levels 1 and 8, order w2 w1 w1 w2, code at HEAD from /work/base (a worktree), alone.
OUT=/work/main/bench_results/serve-s23/wide
n=0
for v in ${ORDER:-wide2 wide1 wide1 wide2}; do
  n=$((n+1))
  echo "$n $v $(date -u +%T)" >> $OUT/runs.txt
  S2D_CHECKOUT=/work/base LEVELS=1,8 bash /work/main/bench_results/serve-s8/ab/ab8.sh $OUT/$n-$v $OUT/local-$v.yaml
done
echo all done $(date -u +%T) >> $OUT/runs.txt
