#!/usr/bin/env bash
# Session 8 A/B: served S2D vs plain for each YAML given, levels $LEVELS (default 1,8). usage: ab8.sh OUT yaml...
set -u
cd ${S2D_CHECKOUT:-/work/main}   # the checkout whose code serves (serve run puts its cwd first on sys.path)
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1
OUT=$1; shift
mkdir -p $OUT
for y in "$@"; do
  tag=$(basename $y .yaml)
  echo "$tag start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/times.txt
  timeout 1500 /work/main/.venv/bin/serve run $y > $OUT/serve-$tag.log 2>&1 &
  pid=$!
  for i in $(seq 1 150); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 2; done
  sleep 5
  timeout 1200 /work/main/.venv/bin/s2d bench serve --url http://127.0.0.1:8000 --model smollm2-135m-instruct \
    --concurrency ${LEVELS:-1,8} --requests 24 --max-seconds ${MAXS:-60} --max-tokens 64 --compare-plain ${CHECK:-} \
    --out $OUT/$tag > $OUT/bench-$tag.log 2>&1
  curl -s http://127.0.0.1:8000/health > $OUT/health-$tag.json
  echo "$tag done $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/times.txt
  kill -INT $pid; for i in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done; kill $pid 2>/dev/null; sleep 3
done
echo done
