#!/usr/bin/env bash
# Session 27: the Router class in a plain process (router_in_process.py, REPEAT=2) against the bare engine
# (inproc_load.py, c1 twice), alternated; the second pass of each is warm. Run alone under quiet.sh. usage: OUT
set -u
cd ${S2D_CHECKOUT:-/work/main}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 REPEAT=2 WIDE=2 STEPS=4
export QUESTIONS=/work/shared/data/spec_bench/question.jsonl
OUT=$1; mkdir -p $OUT
for r in 1 2; do
  echo "$r engine $(date -u +%T)" >> $OUT/times.txt
  PYTHONPATH=$PWD timeout 600 .venv/bin/python scripts/served_overhead/inproc_load.py auto s2d 1 1 2>/dev/null \
    | grep '^{' | sed 's/^{/{"arm": "engine", /' >> $OUT/results.jsonl
  echo "$r router $(date -u +%T)" >> $OUT/times.txt
  timeout 600 .venv/bin/python scripts/served_overhead/router_in_process.py deployments/local.yaml s2d 24 2>/dev/null \
    | grep '^{' | sed 's/^{/{"arm": "router", /' >> $OUT/results.jsonl
done
echo "done $(date -u +%T)" >> $OUT/times.txt
