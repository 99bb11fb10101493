#!/usr/bin/env bash
# Session 25: served c1 with the instruct target's replica alone on core 1 and every other process (router with the
# draft, proxy, controller, Ray, the bench client) on core 0, wide_threads 1 (one core each). Does the served c1 round
# lose to what shares the target's core? Run alone under quiet.sh. usage: pinned.sh OUT
set -u
OUT=$1; mkdir -p $OUT; cd /work/main
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1
timeout 900 .venv/bin/serve run bench_results/serve-s25/c1ab/yaml/wide1.yaml > $OUT/serve.log 2>&1 &
pid=$!
for i in $(seq 1 150); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 2; done
sleep 5
for p in /proc/[0-9]*; do
  c=$(tr '\0' ' ' < $p/cmdline 2>/dev/null) || continue
  case "$c" in *ServeReplica:s2d:target-smollm2-135m-instruct\ *|*ServeReplica:s2d:target-smollm2-135m-instruct) core=1 ;; *ray*|*serve*|*python*) core=0 ;; *) continue ;; esac
  taskset -a -p -c $core ${p#/proc/} >> $OUT/pins.txt 2>&1
done
taskset -c 0 .venv/bin/s2d bench serve --url http://127.0.0.1:8000 --model smollm2-135m-instruct --concurrency 1 \
  --requests 24 --max-seconds 60 --max-tokens 64 --compare-plain --out $OUT/bench > $OUT/bench.log 2>&1
kill -INT $pid; for i in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done; kill $pid 2>/dev/null; sleep 3
grep "^| 1 " $OUT/bench/serve.md
