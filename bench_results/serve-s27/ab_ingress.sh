#!/usr/bin/env bash
# Session 27: the HTTP ingress A/B. The in-process S2D twin at c1, then for each arm a fresh
# `serve run deployments/local.yaml` with the arm's environment and `s2d bench serve` at c1 (S2D and AR, the bench's
# 24 prompts, 64 tokens, 4 warm-up requests per variant), plus the CPU seconds each Serve process spent.
# Arms: proxy = Serve's Python proxy (default); haproxy = RAY_SERVE_ENABLE_HA_PROXY=1 (HAProxy on :8000 forwards to
# the router replica's own HTTP server: Serve's direct ingress). Run alone under quiet.sh. usage: ab_ingress.sh OUT ARM...
set -u
cd ${S2D_CHECKOUT:-/work/main}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1
export QUESTIONS=/work/shared/data/spec_bench/question.jsonl
OUT=$1; shift; mkdir -p $OUT
echo "start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/times.txt
if [ "${TWIN:-1}" = 1 ]; then
  PYTHONPATH=$PWD WIDE=2 timeout 900 .venv/bin/python scripts/served_overhead/inproc_load.py auto s2d 1 2>/dev/null \
    | grep '^{' | sed 's/^{/{"mode": "s2d", /' >> $OUT/inproc_twins.jsonl
fi
n=0
for arm in "$@"; do
  n=$((n+1)); tag=$n-$arm
  case $arm in
    proxy) envs="" ;;
    haproxy) envs="RAY_SERVE_ENABLE_HA_PROXY=1" ;;
    *) echo "unknown arm $arm"; exit 2 ;;
  esac
  echo "$tag start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/times.txt
  env $envs timeout 1500 .venv/bin/serve run deployments/local.yaml > $OUT/$tag.serve.log 2>&1 &
  pid=$!
  for i in $(seq 1 150); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 2; done
  for i in $(seq 1 60); do .venv/bin/serve status 2>/dev/null | grep -q "status: RUNNING" && break; sleep 2; done
  sleep 5
  timeout 900 .venv/bin/s2d bench serve --url http://127.0.0.1:8000 --model smollm2-135m-instruct \
    --concurrency 1 --requests 24 --max-seconds 60 --max-tokens 64 --compare-plain \
    --out $OUT/$tag > $OUT/$tag.bench.log 2>&1
  ps -o pid,time,cmd -e | grep -i "ProxyActor\|HAProxyManager\|haproxy -db\|ServeReplica\|ServeController\|raylet\|gcs_server" \
    | grep -v grep | cut -c1-120 > $OUT/$tag.cpu.txt
  kill -INT $pid; for i in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done; kill $pid 2>/dev/null; sleep 3
  .venv/bin/ray stop --force > /dev/null 2>&1; sleep 2
done
echo "done $(date -u +%T)" >> $OUT/times.txt
