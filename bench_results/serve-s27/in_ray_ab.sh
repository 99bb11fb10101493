#!/usr/bin/env bash
# Session 27: the Router class (draft and instruct target placed in it, local.yaml's settings) decoding the bench's 24
# prompts twice (the second pass warm) in a plain process and inside a bare Ray actor (no Serve, no HTTP),
# alternated: does a Ray worker process slow the router's forwards? Run alone under quiet.sh. usage: in_ray_ab.sh OUT
set -u
cd ${S2D_CHECKOUT:-/work/main}
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 REPEAT=2
OUT=$1; mkdir -p $OUT
for r in 1 2; do
  for arm in plain ray; do
    echo "$r $arm $(date -u +%T)" >> $OUT/times.txt
    if [ $arm = ray ]; then export IN_RAY=1; else unset IN_RAY; fi
    timeout 600 .venv/bin/python scripts/served_overhead/router_in_process.py deployments/local.yaml s2d 24 \
      2> $OUT/$r-$arm.err | grep '^{' >> $OUT/results.jsonl
    .venv/bin/ray stop --force > /dev/null 2>&1
  done
done
echo "done $(date -u +%T)" >> $OUT/times.txt
