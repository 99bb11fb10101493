#!/usr/bin/env bash
# Session 8: in-process twins (ar, s2d at c1 and c8: the bench's 24 Spec-Bench prompts, 64 tokens), then served S2D vs
# served plain in ONE app (deployments/local.yaml) at c 1..16. Run under quiet.sh.
set -u
cd /work/main
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1
export QUESTIONS=/work/shared/data/spec_bench/question.jsonl
export WIDE=2  # the twins run as local.yaml does: 1 thread, wide passes on 2
OUT=${1:-/tmp/sb7}
mkdir -p $OUT
echo "start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" > $OUT/times.txt
PYTHONPATH=$PWD timeout 900 .venv/bin/python scripts/served_overhead/inproc_load.py auto ar 1 8 2>/dev/null | grep '^{' | sed 's/^/{"mode": "ar", /; s/^{"mode": "ar", {/{"mode": "ar", /' > $OUT/inproc_twins.jsonl
PYTHONPATH=$PWD timeout 900 .venv/bin/python scripts/served_overhead/inproc_load.py auto s2d 1 8 2>/dev/null | grep '^{' | sed 's/^{/{"mode": "s2d", /' >> $OUT/inproc_twins.jsonl
echo "twins done $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/times.txt
timeout 1500 .venv/bin/serve run deployments/local.yaml > $OUT/serve.log 2>&1 &
pid=$!
for i in $(seq 1 150); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 2; done
sleep 5
timeout 1200 .venv/bin/s2d bench serve --url http://127.0.0.1:8000 --model smollm2-135m-instruct \
  --concurrency 1,2,4,8,16 --requests 24 --max-seconds 60 --max-tokens 64 --compare-plain ${CHECK:-} \
  --out $OUT/serve-local > $OUT/bench-serve.log 2>&1
curl -s http://127.0.0.1:8000/health > $OUT/health.json
echo "served done $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/times.txt
kill -INT $pid; for i in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done; kill $pid 2>/dev/null; sleep 3
echo done
