#!/usr/bin/env bash
cd /work/main; export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1
D=${OUT:-/tmp/client}; mkdir -p $D
timeout 1500 .venv/bin/serve run deployments/local.yaml > $D/serve.log 2>&1 &
pid=$!
for i in $(seq 1 150); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 2; done
sleep 5
.venv/bin/python scripts/served_overhead/c1_stream_or_not.py s2d 4 stream > /dev/null
for r in 1 2; do
  /usr/bin/time -f "light cpu_user %U sys %S wall %e" -a -o $D/times.txt .venv/bin/python scripts/served_overhead/c1_stream_or_not.py s2d 24 stream >> $D/out.txt
  /usr/bin/time -f "bench cpu_user %U sys %S wall %e" -a -o $D/times.txt .venv/bin/s2d bench serve --url http://127.0.0.1:8000 --model smollm2-135m-instruct --concurrency 1 --requests 24 --max-seconds 60 --max-tokens 64 --out $D/b$r > $D/bench$r.log 2>&1
done
kill -INT $pid; for i in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done; kill $pid 2>/dev/null; sleep 3
