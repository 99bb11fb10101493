#!/bin/bash
# alternate base / new S2D in-process twins (served settings), c1 and c8
cd /work/main
for arm in $ORDER; do
  if [ $arm = base ]; then PP=/work/base; else PP=/work/main; fi
  echo "== $arm $(date +%T)"
  (cd $PP && PYTHONPATH=$PP WIDE=2 STEPS=4 QUESTIONS=/work/shared/data/spec_bench/question.jsonl /work/main/.venv/bin/python /work/main/scripts/served_overhead/inproc_load.py float32 s2d 1 8 2>&1 | grep '^{')
done
