#!/usr/bin/env bash
# Session 27: does the model thread's niceness explain served S2D's gap to its twin? One local.yaml app; `s2d bench
# serve --twin` at c1 (S2D only, 3 pairs) with the router replica's threads at Ray's nice 15, then reniced to 0,
# alternated. Run alone under quiet.sh. usage: nice_ab.sh OUT [ORDER...] (default 15 0 15 0)
set -u
cd ${S2D_CHECKOUT:-/work/main}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1
export QUESTIONS=/work/shared/data/spec_bench/question.jsonl
OUT=$1; shift; mkdir -p $OUT
ORDER=${@:-15 0 15 0}
timeout 3000 .venv/bin/serve run deployments/local.yaml > $OUT/serve.log 2>&1 &
pid=$!
for i in $(seq 1 150); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 2; done
for i in $(seq 1 60); do .venv/bin/serve status 2>/dev/null | grep -q "status: RUNNING" && break; sleep 2; done
sleep 5
RP=$(pgrep -f "ServeReplica:s2d:router" | head -1)
n=0
for nice in $ORDER; do
  n=$((n+1))
  for t in /proc/$RP/task/*; do renice -n $nice -p $(basename $t) > /dev/null; done
  echo "$n nice $nice $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/times.txt
  timeout 1200 .venv/bin/s2d bench serve --url http://127.0.0.1:8000 --model smollm2-135m-instruct \
    --concurrency 1 --requests 24 --max-seconds 60 --max-tokens 64 --questions $QUESTIONS \
    --twin deployments/local.yaml --twin-pairs ${PAIRS:-3} --out $OUT/$n-nice$nice > $OUT/$n-nice$nice.log 2>&1
done
kill -INT $pid; for i in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done; kill $pid 2>/dev/null; sleep 3
.venv/bin/ray stop --force > /dev/null 2>&1
echo "done $(date -u +%T)" >> $OUT/times.txt
