#!/usr/bin/env bash
# The prepared GPU run: exactness on CUDA, then `s2d bench gpu-check` (the fleet model's device row, the engine's
# rounds on a 7B shape, verify grids of 7B/13B/70B-TP4-rank shapes). A few minutes on an H100/H200; nothing is
# downloaded (random bf16 weights; tiny models for the exactness tests). Results land in $OUT (default
# bench_results/gpu-check); BENCHMARKS.md, GPU rounds, reads them.
#   scripts/gpu_check.sh            # on the GPU machine, from any directory
#   scripts/gpu_check.sh --tiny     # dry run on a CPU: the same code path with tiny widths
# Every step runs whatever the one before did (a failed test still leaves the timings), each under its own limit
# (TEST_LIMIT_S, BENCH_LIMIT_S), and writes its files as it goes, so a run cut short still returns what it measured.
# PYTHON (default python3) runs it. Exit status: any failure.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_results/gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
(nvidia-smi || echo "no nvidia-smi") > "$OUT/nvidia-smi.txt" 2>&1
# A GPU image with torch and transformers but without pydantic and no network: put pydantic's wheels (pydantic,
# pydantic_core, annotated-types, typing-inspection, for the image's Python) in .whl/ and they are installed offline.
if ! $PY -c "import pydantic" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
rc=0
# 1. exactness on CUDA, eager and with CUDA graphs (skipped, with the reason, where torch sees no GPU)
timeout "${TEST_LIMIT_S:-150}" $PY -m pytest -q -rs -p no:cacheprovider tests/unit/test_devices.py tests/unit/test_graphs.py \
    tests/unit/test_train.py::test_cuda_run_trains_and_its_checkpoint_resumes_on_the_cpu 2>&1 \
    | tee "$OUT/test_devices.txt" || rc=1
# 2-3. device row, the engine's rounds on the 7B shape, verify grids of 7B/13B/70B-TP4-rank shapes
timeout "${BENCH_LIMIT_S:-300}" $PY -m s2d_ray.bench.gpu_check --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log" || rc=1
exit $rc
