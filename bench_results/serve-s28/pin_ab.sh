#!/usr/bin/env bash
# Session 28. Run alone under quiet.sh, with `serve run deployments/local.yaml` up on :8000. usage: OUT
# one running app; twin pairs unpinned, with the router's model thread pinned to CPU 0 and its other threads to CPU 1, then unpinned
set -u
cd ${S2D_CHECKOUT:-/work/main}
export HF_HUB_OFFLINE=1 QUESTIONS=/work/shared/data/spec_bench/question.jsonl
OUT=$1; mkdir -p $OUT
p=$(pgrep -f "ServeReplica:s2d:router")
pairs() {
  timeout 900 .venv/bin/s2d bench serve --url http://127.0.0.1:8000 --model smollm2-135m-instruct \
    --concurrency 1 --requests 24 --max-seconds 60 --max-tokens 64 --questions $QUESTIONS \
    --twin deployments/local.yaml --twin-pairs 2 --out $OUT/$1 > $OUT/$1.log 2>&1
}
echo "free1 $(date -u +%T)" >> $OUT/times.txt; pairs 1-free
model=$(for t in /proc/$p/task/*; do echo "$(basename $t) $(awk '{print $14+$15}' $t/stat)"; done | sort -k2 -n -r | head -1 | cut -d' ' -f1)
echo "model thread $model" >> $OUT/times.txt
for t in /proc/$p/task/*; do tid=$(basename $t); if [ $tid = $model ]; then taskset -pc 0 $tid >/dev/null; else taskset -pc 1 $tid > /dev/null; fi; done
echo "pinned $(date -u +%T)" >> $OUT/times.txt; pairs 2-pinned
for t in /proc/$p/task/*; do taskset -pc 0-1 $(basename $t) >/dev/null; done
echo "free2 $(date -u +%T)" >> $OUT/times.txt; pairs 3-free
echo "done $(date -u +%T)" >> $OUT/times.txt
