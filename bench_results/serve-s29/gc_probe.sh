#!/usr/bin/env bash
# one app: /health before and after a c1 level of 24 requests (no twin): the router's GC pauses while serving
set -u
cd /work/main
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1
export QUESTIONS=/work/shared/data/spec_bench/question.jsonl
OUT=$1; shift; mkdir -p $OUT
for Y in "$@"; do
  tag=$(basename $Y .yaml)
  timeout 900 .venv/bin/serve run $Y > $OUT/$tag.serve.log 2>&1 &
  pid=$!
  for i in $(seq 1 150); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 2; done
  for i in $(seq 1 60); do .venv/bin/serve status 2>/dev/null | grep -q "status: RUNNING" && break; sleep 2; done
  sleep 5
  curl -s http://127.0.0.1:8000/health > $OUT/$tag.health0.json
  timeout 600 .venv/bin/s2d bench serve --url http://127.0.0.1:8000 --model smollm2-135m-instruct \
    --concurrency 1,4 --requests 24 --max-seconds 40 --max-tokens 64 --questions $QUESTIONS --out $OUT/$tag > $OUT/$tag.log 2>&1
  curl -s http://127.0.0.1:8000/health > $OUT/$tag.health1.json
  kill -INT $pid; for i in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done; kill $pid 2>/dev/null; sleep 3
  .venv/bin/ray stop --force > /dev/null 2>&1; sleep 2
done
