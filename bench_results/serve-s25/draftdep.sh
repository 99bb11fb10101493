#!/usr/bin/env bash
# Session 25: served c1 with the draft as its own deployment (c1ab/yaml/draftdep.yaml: placement deployment, draft 0.3
# CPUs, router 0.2) against local.yaml as shipped (the draft in the router), alternated. Is the router's draft slower
# than the twin's because it shares the router's process (event loop, GIL)? Run alone under quiet.sh.
D=/work/main/bench_results/serve-s25/draftdep; n=0
for v in ${ORDER:-draftdep local draftdep}; do
  n=$((n+1)); LEVELS=1 bash /work/main/bench_results/serve-s8/ab/ab8.sh $D/$n-$v /work/main/bench_results/serve-s25/c1ab/yaml/$v.yaml
done
