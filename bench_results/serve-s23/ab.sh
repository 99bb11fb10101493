#!/usr/bin/env bash
# Session 23 (AVX2-only AMD EPYC, `--dtype auto` = float32): served S2D vs served AR through the same app
# (`--compare-plain`), levels 1 and 8, 24 Spec-Bench prompts, 64 tokens, deployments/local.yaml of each checkout:
# base = a worktree at 83ef4b7 in /work/base (session 22: the budget learns a draft depth's cost from catch-up rounds
# too), new = HEAD (from warm drafting rounds only). The same A/B loop as session 21's. Run alone, under quiet.sh.
OUT=${OUT:-/work/main/bench_results/serve-s23/ab} exec bash /work/main/bench_results/serve-s21/ab.sh
