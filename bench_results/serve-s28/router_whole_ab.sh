#!/usr/bin/env bash
# Session 28: the Router class in a plain process (router_in_process.py: the draft and the instruct target placed in
# it, local.yaml's settings, 8 prompts, one cold pass) with router.whole_rounds on (WHOLE=1) and off (WHOLE=0),
# alternated. Run alone under quiet.sh. usage: OUT
set -u
cd ${S2D_CHECKOUT:-/work/main}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 HF_HUB_OFFLINE=1 QUESTIONS=/work/shared/data/spec_bench/question.jsonl
OUT=$1; mkdir -p $OUT
for w in 1 0 1 0; do
  echo "whole=$w $(date -u +%T) code $(git rev-parse --short HEAD)" >> $OUT/times.txt
  WHOLE=$w timeout 600 .venv/bin/python scripts/served_overhead/router_in_process.py deployments/local.yaml s2d 8 \
    2>/dev/null | grep '^{' >> $OUT/results.jsonl
done
echo "done $(date -u +%T)" >> $OUT/times.txt
