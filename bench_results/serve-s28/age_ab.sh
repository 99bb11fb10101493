#!/usr/bin/env bash
# Session 28. Run alone under quiet.sh, with `serve run deployments/local.yaml` up on :8000. usage: OUT
# the same running app, more twin-pair invocations: does the served/twin ratio move with the app's age?
set -u
cd ${S2D_CHECKOUT:-/work/main}
export HF_HUB_OFFLINE=1 QUESTIONS=/work/shared/data/spec_bench/question.jsonl
OUT=$1; mkdir -p $OUT
for k in 4 5 6; do
  echo "$k $(date -u +%T)" >> $OUT/times.txt
  timeout 900 .venv/bin/s2d bench serve --url http://127.0.0.1:8000 --model smollm2-135m-instruct \
    --concurrency 1 --requests 24 --max-seconds 60 --max-tokens 64 --questions $QUESTIONS \
    --twin deployments/local.yaml --twin-pairs 2 --out $OUT/$k-free > $OUT/$k-free.log 2>&1
done
curl -s http://127.0.0.1:8000/health > $OUT/health.json
echo "done $(date -u +%T)" >> $OUT/times.txt
