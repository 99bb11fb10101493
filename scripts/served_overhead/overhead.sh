#!/usr/bin/env bash
# One-target app (deployments/local.yaml with only the instruct target), sequential streaming requests plain then S2D,
# the router's per-call timing from /health after each; SPY=1 adds py-spy profiles of every Serve process.
# Usage: OUT=/tmp/ovh REQ=12 scripts/served_overhead/overhead.sh   (run it on a quiet machine)
# Served c1 overhead probe: one-target app, py-spy on every Serve process during a c1 run.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/ovh}; rm -rf $out; mkdir -p $out
export HF_HUB_OFFLINE=1
.venv/bin/serve run ${CFG:-scripts/served_overhead/one_target.yaml} > $out/serve.log 2>&1 &
sp=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 2; done
curl -s http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' -d '{"model":"smollm2-135m-instruct","prompt":"Hello","max_tokens":16}' >/dev/null
ps -eo pid,args | grep -E "ServeReplica|ProxyActor|ServeController" | grep -v grep > $out/procs.txt
cat $out/procs.txt
for mode in ${MODES:-plain s2d}; do
  [ -n "${SPY:-}" ] && for p in $(awk '{print $1}' $out/procs.txt); do
    .venv/bin/py-spy record --nonblocking -r 100 -d ${DUR:-25} -f raw -o $out/$mode-$p.txt -p $p >/dev/null 2>&1 &
  done
  .venv/bin/python scripts/served_overhead/c1client.py $mode ${REQ:-12} > $out/client-$mode.json 2>$out/client-$mode.err; cat $out/client-$mode.json
  curl -s http://127.0.0.1:8000/health | python3 -c "import json,sys; d=json.load(sys.stdin); print(json.dumps({k:v['timing'] for k,v in d['targets'].items()}))" | tee $out/timing-$mode.json
  [ -n "${SPY:-}" ] && sleep ${DUR:-25}
done
kill -INT $sp; for i in $(seq 1 30); do kill -0 $sp 2>/dev/null || break; sleep 1; done; kill $sp 2>/dev/null; sleep 3
