cd /work/main
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1
O=/work/main/bench_results/serve-s12/spy; mkdir -p $O
timeout 900 .venv/bin/serve run deployments/local.yaml > $O/serve.log 2>&1 &
pid=$!
for i in $(seq 1 150); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 2; done
sleep 5
.venv/bin/python /tmp/plainload.py 1 0 > $O/warm.txt 2>&1
rp=$(ps -eo pid,args | grep "ServeReplica:s2d:target-smollm2-135m-instruct$" | head -1 | awk "{print \$1}")
ps -eo pid,args | grep ServeReplica > $O/replicas.txt
echo "replica $rp" >> $O/replicas.txt
.venv/bin/py-spy record -r 100 -f raw -o $O/target-plain-c8.txt --pid $rp --nonblocking -d 60 > $O/spy.log 2>&1 &
sp=$!
.venv/bin/python /tmp/plainload.py 2 0 > $O/plain-c8.txt 2>&1
wait $sp
kill -INT $pid; for i in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done; kill $pid 2>/dev/null
echo done
