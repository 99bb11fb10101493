#!/usr/bin/env bash
# A/B of code, not config: deployments/local.yaml served from each checkout given (a worktree of another commit), in
# turn, each into its own numbered folder. `serve run` puts its working directory first on the replicas' sys.path, so
# the checkout is where ab8.sh runs from (PYTHONPATH alone is shadowed by /work/main). usage: ab_code.sh OUT dir...
set -u
OUT=$1; shift
n=0
for d in "$@"; do
  n=$((n + 1))
  S2D_CHECKOUT=$d bash /work/main/bench_results/serve-s8/ab/ab8.sh "$OUT/$n" "$d/deployments/local.yaml"
done
