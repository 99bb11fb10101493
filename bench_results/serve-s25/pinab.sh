#!/usr/bin/env bash
# Session 25: pinned (pinned.sh) against unpinned wide1.yaml (ab8.sh, level 1), alternated. Run alone under quiet.sh.
D=/work/main/bench_results/serve-s25/pinab; mkdir -p $D
n=0
for v in ${ORDER:-pinned wide1 pinned wide1}; do
  n=$((n+1)); echo "$n $v $(date -u +%T)" >> $D/runs.txt
  if [[ $v == pinned ]]; then bash /work/main/bench_results/serve-s25/pinned.sh $D/$n-pinned
  else LEVELS=1 bash /work/main/bench_results/serve-s8/ab/ab8.sh $D/$n-wide1 /work/main/bench_results/serve-s25/c1ab/yaml/wide1.yaml; fi
done
