#!/usr/bin/env bash
# Session 23: served c1 against the in-process twin, the same 24 prompts x 64 tokens (scripts/served_overhead/c1client.py:
# sequential streaming /v1/completions, S2D then AR by the per-request `speculate` flag), for each YAML given; CPU seconds
# per process over the S2D run. Code from /work/base (a worktree at HEAD). Run alone, under quiet.sh.
set -u
OUT=/work/main/bench_results/serve-s23/served
mkdir -p $OUT; cd /work/base
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1
snap() { for p in /proc/[0-9]*; do s=$(cat $p/stat 2>/dev/null) || continue; c=$(tr '\0' ' ' < $p/cmdline 2>/dev/null | cut -c1-70); echo "${p#/proc/} $(echo "$s" | awk '{print $14+$15}') $c"; done; }
for y in "$@"; do
  tag=$(basename $y .yaml)
  timeout 900 /work/main/.venv/bin/serve run $y > $OUT/serve-$tag.log 2>&1 &
  pid=$!
  for i in $(seq 1 150); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 2; done
  sleep 5
  /work/main/.venv/bin/python /work/main/scripts/served_overhead/c1client.py s2d 2 > /dev/null
  snap > $OUT/$tag-before.txt
  /work/main/.venv/bin/python /work/main/scripts/served_overhead/c1client.py s2d 24 > $OUT/$tag-s2d.json
  snap > $OUT/$tag-after.txt
  /work/main/.venv/bin/python /work/main/scripts/served_overhead/c1client.py ar 24 > $OUT/$tag-ar.json
  curl -s http://127.0.0.1:8000/health > $OUT/$tag-health.json
  cat $OUT/$tag-s2d.json $OUT/$tag-ar.json
  kill -INT $pid; for i in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done; kill $pid 2>/dev/null; sleep 3
done
