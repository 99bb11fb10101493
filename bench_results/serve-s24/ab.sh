#!/usr/bin/env bash
# Session 24 (AVX2-only AMD EPYC, `--dtype auto` = float32): served S2D vs served AR through the same app
# (`--compare-plain`), levels 1 and 8, 24 Spec-Bench prompts, 64 tokens, deployments/local.yaml of each checkout:
# base = a worktree at cb70f2a in /work/base (session 23), new = HEAD (a row's draft catch-up priced against what its
# remaining tokens gain). Session 21's A/B loop. Run alone, under quiet.sh.
OUT=${OUT:-/work/main/bench_results/serve-s24/ab} exec bash /work/main/bench_results/serve-s21/ab.sh
