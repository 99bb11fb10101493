#!/usr/bin/env bash
# Session 9 A/B: served S2D vs plain for each YAML given (in turn; a YAML may repeat: outputs are numbered), levels $LEVELS (default 1,8). usage: ab9.sh OUT yaml...
set -u
cd /work/main
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1
OUT=$1; shift
mkdir -p $OUT
for y in "$@"; do
  n=$((${n:-0} + 1)); tag=$n-$(basename $y .yaml)
  echo "$tag start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/times.txt
  timeout 1500 .venv/bin/serve run $y > $OUT/serve-$tag.log 2>&1 &
  pid=$!
  for i in $(seq 1 150); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 2; done
  sleep 5
  timeout 1200 .venv/bin/s2d bench serve --url http://127.0.0.1:8000 --model smollm2-135m-instruct \
    --concurrency ${LEVELS:-1,8} --requests 24 --max-seconds 60 --max-tokens 64 --compare-plain ${CHECK:-} \
    --out $OUT/$tag > $OUT/bench-$tag.log 2>&1
  curl -s http://127.0.0.1:8000/health > $OUT/health-$tag.json
  echo "$tag done $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/times.txt
  kill -INT $pid; for i in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done; kill $pid 2>/dev/null; sleep 3
done
echo done
