#!/usr/bin/env bash
# Where a served c1 S2D round spends its wall time, against the in-process twin: py-spy (wall clock, idle included)
# on the router and target replicas while c1client.py streams N prompts, then on the twin over the same N prompts.
# usage (alone, under quiet.sh): profile_c1.sh YAML OUT [N=12] [RATE=50]; summarise with stacks.py OUT/*.txt (gzip them to keep: stacks.py reads .gz)
set -u
YAML=$1; OUT=$2; N=${3:-12}; RATE=${4:-50}; mkdir -p $OUT; cd ${S2D_CHECKOUT:-/work/main}
PY=/work/main/.venv/bin/python; SPY=/work/main/.venv/bin/py-spy
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1
timeout 900 /work/main/.venv/bin/serve run $YAML > $OUT/serve.log 2>&1 &
pid=$!
for i in $(seq 1 150); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 2; done
sleep 5
$PY scripts/served_overhead/c1client.py s2d 2 > /dev/null
spies=()
for p in /proc/[0-9]*; do
  c=$(tr '\0' ' ' < $p/cmdline 2>/dev/null) || continue
  case "$c" in *ServeReplica:*) ;; *) continue ;; esac
  name=$(echo "$c" | grep -o 'ServeReplica:[^ ]*' | tr ':/' '__')
  $SPY record --idle --threads -r $RATE --format raw -o $OUT/$name-${p#/proc/}.txt --pid ${p#/proc/} > /dev/null 2>&1 &
  spies+=($!)
done
sleep 2
$PY scripts/served_overhead/c1client.py s2d $N > $OUT/client.json
for s in "${spies[@]}"; do kill -INT $s; done; wait "${spies[@]}" 2>/dev/null
cat $OUT/client.json
kill -INT $pid; for i in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done; kill $pid 2>/dev/null; sleep 3
PROMPTS=$N WIDE=2 STEPS=4 $SPY record --idle --threads -r $RATE --format raw -o $OUT/twin.txt -- \
  $PY scripts/served_overhead/inproc_load.py float32 s2d 1 > $OUT/twin.json 2>/dev/null
grep '^{' $OUT/twin.json | cut -c1-120
