#!/usr/bin/env bash
# One-row decode step with and without the one-row MKL copies, alternated, 1 and 2 threads (run alone).
cd "$(dirname "$0")/../.."
for rep in 1 2 3; do for th in 1 2; do for k in several auto; do
  S2D_LINEAR_KERNEL=$k .venv/bin/python bench_results/spec-s22/one_row_kernels.py $th 2>/dev/null | grep kernel=
done; done; done
