#!/usr/bin/env bash
# Where the CPU goes in a served c1 S2D load: serve a YAML, run 24 streaming requests (c1client.py), print CPU seconds
# per process over the load. usage (under quiet.sh): cpu_by_process.sh YAML OUT
set -u
YAML=$1; OUT=$2; mkdir -p $OUT; cd ${S2D_CHECKOUT:-/work/main}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1
timeout 900 /work/main/.venv/bin/serve run $YAML > $OUT/serve.log 2>&1 &
pid=$!
for i in $(seq 1 150); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 2; done
sleep 5
/work/main/.venv/bin/python scripts/served_overhead/c1client.py s2d 2 > /dev/null
snap() { for p in /proc/[0-9]*; do s=$(cat $p/stat 2>/dev/null) || continue; c=$(tr '\0' ' ' < $p/cmdline 2>/dev/null | cut -c1-70); echo "${p#/proc/} $(echo "$s" | awk '{print $14+$15}') $c"; done; }
snap > $OUT/before.txt
/work/main/.venv/bin/python scripts/served_overhead/c1client.py s2d 24 > $OUT/client.json
snap > $OUT/after.txt
cat $OUT/client.json
python3 - $OUT <<'PY'
import sys, os
out = sys.argv[1]; hz = os.sysconf('SC_CLK_TCK')
def load(f):
    d = {}
    for line in open(f):
        parts = line.rstrip('\n').split(' ', 2)
        if len(parts) >= 2 and parts[1].isdigit(): d[parts[0]] = (int(parts[1]), parts[2] if len(parts) > 2 else '')
    return d
a, b = load(f'{out}/before.txt'), load(f'{out}/after.txt')
rows = sorted(((b[p][0] - a.get(p, (0, ''))[0]) / hz, b[p][1]) for p in b)
tot = sum(r[0] for r in rows)
for s, c in rows[::-1][:18]: print(f'{s:7.2f} s  {c}')
print(f'total {tot:.2f} s')
PY
kill -INT $pid; for i in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done; kill $pid 2>/dev/null; sleep 3
