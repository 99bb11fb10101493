#!/usr/bin/env bash
# Session 27: is streaming what served S2D loses at c1? One local.yaml app; the light client
# (scripts/served_overhead/c1_stream_or_not.py, S2D, 24 prompts, 64 tokens) streamed and whole, alternated with the
# in-process twin (inproc_load.py, local.yaml's engine settings). Run alone under quiet.sh. usage: stream_ab.sh OUT
set -u
cd ${S2D_CHECKOUT:-/work/main}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1
export QUESTIONS=/work/shared/data/spec_bench/question.jsonl
OUT=$1; Y=${2:-deployments/local.yaml}; mkdir -p $OUT
timeout 3000 .venv/bin/serve run $Y > $OUT/serve.log 2>&1 &
pid=$!
for i in $(seq 1 150); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 2; done
for i in $(seq 1 60); do .venv/bin/serve status 2>/dev/null | grep -q "status: RUNNING" && break; sleep 2; done
sleep 5
C=scripts/served_overhead/c1_stream_or_not.py
twin() { PYTHONPATH=$PWD WIDE=2 STEPS=4 timeout 600 .venv/bin/python scripts/served_overhead/inproc_load.py auto s2d 1 2>/dev/null | grep '^{' | cut -c1-60 | sed "s/^/twin $(date -u +%T) /" >> $OUT/results.txt; }
served() { echo "served $(date -u +%T) $(.venv/bin/python $C s2d 24 $1)" >> $OUT/results.txt; }
.venv/bin/python $C s2d 4 stream > /dev/null; .venv/bin/python $C s2d 4 non > /dev/null
for r in 1 2; do twin; served stream; served non; twin; served non; served stream; done; twin
kill -INT $pid; for i in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done; kill $pid 2>/dev/null; sleep 3
.venv/bin/ray stop --force > /dev/null 2>&1
echo "done $(date -u +%T)" >> $OUT/results.txt
