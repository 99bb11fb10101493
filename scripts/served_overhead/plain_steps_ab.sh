#!/usr/bin/env bash
# plain_steps 1 vs 4 served by ONE app, alternating A B A B (drift on a shared machine hits both), then the in-process
# continuous-batching twin. Usage (on a quiet machine, from a checkout whose ../shared holds the Spec-Bench questions
# or with QUESTIONS=path): OUT=/tmp/ab scripts/served_overhead/plain_steps_ab.sh
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/ab}; rm -rf $out; mkdir -p $out
PY=${PYTHON:-.venv/bin/python}
q=${QUESTIONS:-../shared/data/spec_bench/question.jsonl}
export HF_HUB_OFFLINE=1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled
$(dirname $PY)/serve run scripts/served_overhead/plain_steps_ab.yaml > $out/serve.log 2>&1 &
sp=$!
for i in $(seq 1 150); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 2; done
sleep 5
for pass in 1 2; do
  for model in steps1 steps4; do
    $PY -m s2d_ray.cli bench serve --url http://127.0.0.1:8000 --model $model --questions $q --concurrency ${LEVELS:-1,8} \
      --requests 24 --max-seconds 60 --max-tokens 64 --out $out/$model-$pass > $out/$model-$pass.log 2>&1
    grep -E "^\| [0-9]+ \|" $out/$model-$pass/serve.md | sed "s/^/$model pass $pass: /"
  done
done
kill -INT $sp; for i in $(seq 1 30); do kill -0 $sp 2>/dev/null || break; sleep 1; done; kill $sp 2>/dev/null; sleep 3
[ -z "${NOTWIN:-}" ] && QUESTIONS=$q $PY scripts/served_overhead/inproc_load.py auto ar 1 8 2>/dev/null | tee $out/inproc.log
