#!/usr/bin/env bash
# alternate: veto (main) / noveto (worktree of the commit before) with deployments/local.yaml, levels 1,8
set -u
OUT=$1; mkdir -p $OUT; n=0
for v in veto noveto noveto veto; do
  n=$((n + 1))
  if [ $v = noveto ]; then export PYTHONPATH=/work/wt/noveto; else unset PYTHONPATH; fi
  cp /work/main/deployments/local.yaml /tmp/$v.yaml
  bash /work/main/bench_results/serve-s8/ab/ab8.sh $OUT/$n /tmp/$v.yaml
done
