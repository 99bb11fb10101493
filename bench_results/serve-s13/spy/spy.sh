# S2D at concurrency 1, served: py-spy raw stacks of the instruct target replica and the router (draft inside);
# then the in-process twin under py-spy. Usage: bash spy.sh (from anywhere; ~6 min)
cd /work/main
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1
O=/work/main/bench_results/serve-s13/spy; L=/work/main/bench_results/serve-s12/spy/plainload.py  # plainload.py REPEAT SPECULATE(0/1) [CONCURRENCY=8]
timeout 900 .venv/bin/serve run deployments/local.yaml > $O/serve.log 2>&1 &
pid=$!
for i in $(seq 1 150); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 2; done
sleep 5
.venv/bin/python $L 1 1 1 > $O/warm.txt 2>&1
rp=$(ps -eo pid,args | grep "ServeReplica:s2d:target-smollm2-135m-instruct$" | head -1 | awk "{print \$1}")
ro=$(ps -eo pid,args | grep "ServeReplica:s2d:router$" | head -1 | awk "{print \$1}")
ps -eo pid,args | grep ServeReplica > $O/replicas.txt
echo "replica $rp router $ro" >> $O/replicas.txt
.venv/bin/py-spy record -r 100 -f raw -o $O/target-s2d-c1.txt --pid $rp --nonblocking -d 60 > $O/spy.log 2>&1 &
s1=$!
.venv/bin/py-spy record -r 100 -f raw -o $O/router-s2d-c1.txt --pid $ro --nonblocking -d 60 > $O/spy2.log 2>&1 &
s2=$!
.venv/bin/python $L 1 1 1 > $O/s2d-c1.txt 2>&1
wait $s1 $s2
curl -s http://127.0.0.1:8000/health > $O/stats.json 2>/dev/null || true
kill -INT $pid; for i in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done; kill $pid 2>/dev/null
sleep 3
export QUESTIONS=/work/shared/data/spec_bench/question.jsonl WIDE=2 PYTHONPATH=/work/main
.venv/bin/py-spy record -r 100 -f raw -o $O/twin-s2d-c1.txt --nonblocking -- .venv/bin/python scripts/served_overhead/inproc_load.py auto s2d 1 > $O/twin-s2d-c1.log 2>&1
echo done
