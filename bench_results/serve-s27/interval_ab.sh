#!/usr/bin/env bash
# Session 27: router.stream_interval 1 (local.yaml as shipped) against 8 (yaml/interval8.yaml), each a fresh app,
# `s2d bench serve --twin` at c1 (S2D only, 3 pairs against the warm in-process twin). Run alone under quiet.sh.
# usage: interval_ab.sh OUT YAML...
set -u
cd ${S2D_CHECKOUT:-/work/main}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1
export QUESTIONS=/work/shared/data/spec_bench/question.jsonl
OUT=$1; shift; mkdir -p $OUT; n=0
for Y in "$@"; do
  n=$((n+1)); tag=$n-$(basename $Y .yaml)
  echo "$tag $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg) code $(git rev-parse --short HEAD)" >> $OUT/times.txt
  timeout 1500 .venv/bin/serve run $Y > $OUT/$tag.serve.log 2>&1 &
  pid=$!
  for i in $(seq 1 150); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 2; done
  for i in $(seq 1 60); do .venv/bin/serve status 2>/dev/null | grep -q "status: RUNNING" && break; sleep 2; done
  sleep 5
  timeout 1200 .venv/bin/s2d bench serve --url http://127.0.0.1:8000 --model smollm2-135m-instruct \
    --concurrency 1 --requests 24 --max-seconds 60 --max-tokens 64 --questions $QUESTIONS \
    --twin $Y --twin-pairs ${PAIRS:-3} --out $OUT/$tag > $OUT/$tag.log 2>&1
  curl -s http://127.0.0.1:8000/health > $OUT/$tag.health.json
  kill -INT $pid; for i in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done; kill $pid 2>/dev/null; sleep 3
  .venv/bin/ray stop --force > /dev/null 2>&1; sleep 2
done
echo "done $(date -u +%T)" >> $OUT/times.txt
