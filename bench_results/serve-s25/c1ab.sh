#!/usr/bin/env bash
# Session 25: served c1 (S2D and AR through one app) under three settings of deployments/local.yaml, alternated:
# local (as shipped), wide1 (wide_threads 1), passive (OMP_WAIT_POLICY=PASSIVE in the replicas' environment). YAMLs in
# bench_results/serve-s25/c1ab/yaml. Run alone under quiet.sh.
D=/work/main/bench_results/serve-s25/c1ab
mkdir -p $D/yaml; [ -d /work/notes/y ] && cp /work/notes/y/*.yaml $D/yaml/   # the YAMLs are committed there
n=0
for v in ${ORDER:-local passive wide1 local passive wide1}; do
  n=$((n+1)); mkdir -p $D/$n && cp $D/yaml/$v.yaml $D/$n/$v.yaml
  LEVELS=1 bash /work/main/bench_results/serve-s8/ab/ab8.sh $D/$n $D/$n/$v.yaml
done
