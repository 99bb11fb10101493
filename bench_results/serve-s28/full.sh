#!/usr/bin/env bash
# Session 27 (rerun in 28): the full served run on local.yaml as shipped (levels 1-16, S2D and AR in one app, greedy check), then
# --twin: served and in-process (the router's engine for the instruct target, built by the bench from the same YAML)
# alternated at c1, 3 pairs per variant. Run alone under quiet.sh. usage: full.sh OUT
set -u
cd ${S2D_CHECKOUT:-/work/main}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1
export QUESTIONS=/work/shared/data/spec_bench/question.jsonl
OUT=${1:-/tmp/full27}; LEVELS=${LEVELS:-1,2,4,8,16}; mkdir -p $OUT
echo "start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg) code $(git rev-parse --short HEAD)" >> $OUT/times.txt
timeout 3000 .venv/bin/serve run deployments/local.yaml > $OUT/serve.log 2>&1 &
pid=$!
for i in $(seq 1 150); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 2; done
for i in $(seq 1 60); do .venv/bin/serve status 2>/dev/null | grep -q "status: RUNNING" && break; sleep 2; done
sleep 5
echo "served start $(date -u +%T)" >> $OUT/times.txt
timeout 2700 .venv/bin/s2d -v bench serve --url http://127.0.0.1:8000 --model smollm2-135m-instruct \
  --concurrency $LEVELS --requests 24 --max-seconds 60 --max-tokens 64 --compare-plain ${CHECK---check-greedy} \
  --questions $QUESTIONS --twin deployments/local.yaml --twin-pairs ${PAIRS:-3} --out $OUT/serve-local \
  > $OUT/bench-serve.log 2>&1
echo "bench rc $? $(date -u +%T)" >> $OUT/times.txt
curl -s http://127.0.0.1:8000/health > $OUT/health.json
kill -INT $pid; for i in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done; kill $pid 2>/dev/null; sleep 3
.venv/bin/ray stop --force > /dev/null 2>&1
echo "done $(date -u +%T)" >> $OUT/times.txt
