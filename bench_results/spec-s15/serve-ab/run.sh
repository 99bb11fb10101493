#!/usr/bin/env bash
# Served config A/B (session 15): lookup_candidates 4 against the profile's 1, deployments/local.yaml otherwise;
# levels 1 and 8, 24 requests of 64 tokens, --compare-plain; order lc4, base, base, lc4. Run under quiet.sh.
D=/work/main/bench_results/spec-s15/serve-ab
LEVELS=1,8 bash /work/main/bench_results/serve-s8/ab/ab8.sh $D/pair1 $D/lc4.yaml $D/base.yaml
LEVELS=1,8 bash /work/main/bench_results/serve-s8/ab/ab8.sh $D/pair2 $D/base.yaml $D/lc4.yaml
