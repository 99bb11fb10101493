#!/usr/bin/env bash
# Session 26: serve a YAML, then concurrency-1 S2D / plain, streamed / whole, alternated twice (light client:
# scripts/served_overhead/c1_stream_or_not.py). Run alone under quiet.sh. usage: c1stream.sh YAML OUT
cd ${S2D_CHECKOUT:-/work/main}; export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1
Y=${1:-deployments/local.yaml}; OUT=${2:-/tmp/c1stream.out}
timeout 1500 .venv/bin/serve run $Y > $OUT.serve.log 2>&1 &
pid=$!
for i in $(seq 1 150); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 2; done
sleep 5
C=scripts/served_overhead/c1_stream_or_not.py
.venv/bin/python $C s2d 4 stream > /dev/null  # warm
for r in 1 2; do for m in s2d ar; do for s in stream non; do .venv/bin/python $C $m 24 $s >> $OUT; done; done; done
curl -s http://127.0.0.1:8000/health > $OUT.health.json
kill -INT $pid; for i in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done; kill $pid 2>/dev/null; sleep 3
