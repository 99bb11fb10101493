#!/usr/bin/env bash
# Session 12: base (77fc344) vs new (d5e2c7f, prompt-round deferral) vs new with RAY_worker_niceness=0, alternating twice.
OUT=/work/main/bench_results/serve-s12/runs
mkdir -p $OUT
n=0
for rep in 1; do
  for v in runs before before runs; do
    n=$((n+1))
    d=/work/wt/$v; [[ $v == nice0 ]] && d=/work/wt/new
    echo "$n $v $(date -u +%T)" >> $OUT/runs.txt
    if [[ $v == nice0 ]]; then
      RAY_worker_niceness=0 S2D_CHECKOUT=$d LEVELS=1,8 bash /work/main/bench_results/serve-s8/ab/ab8.sh $OUT/$n-$v $d/deployments/local.yaml
    else
      S2D_CHECKOUT=$d LEVELS=1,8 bash /work/main/bench_results/serve-s8/ab/ab8.sh $OUT/$n-$v $d/deployments/local.yaml
    fi
    true
  done
done
echo all done $(date -u +%T) >> $OUT/runs.txt
bash /tmp/spy.sh
