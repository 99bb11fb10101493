# Page faults and system time of the served target replica and router under S2D c1, against the in-process twin.
# usage: faults.sh OUT [yaml]  (under quiet.sh; ~4 min)
cd /work/main
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1
O=$1; Y=${2:-deployments/local.yaml}; mkdir -p $O; L=/work/main/bench_results/serve-s12/spy/plainload.py
timeout 900 .venv/bin/serve run $Y > $O/serve.log 2>&1 &
pid=$!
for i in $(seq 1 150); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 2; done
sleep 5
rp=$(pgrep -f "ServeReplica:s2d:target-smollm2-135m-instruct$" | head -1)
ro=$(pgrep -f "ServeReplica:s2d:router$" | head -1)
.venv/bin/python $L 1 1 1 > $O/load.txt 2>&1 &
lp=$!
sleep 15
perf stat -e page-faults,context-switches,cpu-migrations,task-clock -p $rp -- sleep 20 > $O/perfstat-target.txt 2>&1 &
perf stat -e page-faults,context-switches,cpu-migrations,task-clock -p $ro -- sleep 20 > $O/perfstat-router.txt 2>&1
sleep 1
perf record -e page-faults -g -o $O/target-faults.data -p $rp -- sleep 10 > /dev/null 2>&1
wait $lp
perf report -i $O/target-faults.data --stdio --no-children --percent-limit 2 2>/dev/null | head -150 > $O/target-faults.txt
rm -f $O/target-faults.data
kill -INT $pid; for i in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done; kill $pid 2>/dev/null
sleep 3
export QUESTIONS=/work/shared/data/spec_bench/question.jsonl WIDE=2 PYTHONPATH=/work/main
perf stat -e page-faults,context-switches,cpu-migrations,task-clock -- .venv/bin/python scripts/served_overhead/inproc_load.py auto s2d 1 > $O/twin.txt 2>&1
echo done
