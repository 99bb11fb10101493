#!/usr/bin/env bash
# fresh server per arm: s2d bench serve c1 (speculative only) with --warmup W
cd /work/main; export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1
D=${OUT:-/tmp/warm}; mkdir -p $D
for W in ${ORDER:-1 4}; do
  timeout 1500 .venv/bin/serve run deployments/local.yaml > $D/serve-$W.log 2>&1 &
  pid=$!
  for i in $(seq 1 150); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 2; done
  sleep 5
  .venv/bin/s2d bench serve --url http://127.0.0.1:8000 --model smollm2-135m-instruct --concurrency 1 --requests 24 --max-seconds 60 --max-tokens 64 --warmup $W --out $D/w$W > $D/bench-$W.log 2>&1
  for sp in true false; do curl -s http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' -d "{\"model\": \"smollm2-135m-instruct\", \"prompt\": \"Explain why the sky is blue in two sentences.\", \"max_tokens\": 64, \"temperature\": 0, \"speculate\": $sp, \"return_token_ids\": true}" >> $D/fallback-$W.json; echo >> $D/fallback-$W.json; done
  grep "^| 1 |" $D/bench-$W.log | head -1 | sed "s/^/warmup $W: /" >> $D/summary.txt
  kill -INT $pid; for i in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done; kill $pid 2>/dev/null; sleep 3
done
