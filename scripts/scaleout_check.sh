#!/usr/bin/env bash
# Real-model scale-out runs WITH the greedy check (tests/serve/scaleout_run.py --check-greedy): every response's token
# ids against in-process greedy of the same prompt (the project's engine, --mode ar, same dtype). Real
# SmolLM2-135M-Instruct + the committed draft, deployments/replicas.yaml, 127.0.0.1, concurrency 16, max_tokens 48.
# RELIABILITY.md states what these runs guarantee.
#
#   scripts/scaleout_check.sh OUT_DIR [pair|scaledown|faults|all]
#
# pair:      2 vs 1 replica of each, the shipped config (dtype auto = bf16 on CPUs with native bf16), 96 requests each,
#            back to back
# scaledown: 2 -> 1 replica of each by redeploy 15 s into 64 requests
# faults:    a draft replica killed 10 s into 64 requests, then a target replica
# scaledown and faults run the shipped config (dtype auto); DTYPE=float32 runs them in fp32 with a fixed k = 4
# (fp32's calibration models no gain, so its budget would leave the draft idle and the check would not exercise
# speculation); the run names end in the dtype.
# Environment: PYTHON (default .venv/bin/python), QUESTIONS (Spec-Bench's question.jsonl; default the one under
# S2D_DATA_DIR, else built-in prompts), LIMIT_S (600: each phase's time limit). Run it on an otherwise idle machine.
set -euo pipefail
out=${1:?usage: scripts/scaleout_check.sh OUT_DIR [pair|scaledown|faults|all]}
phase=${2:-all}
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
limit="timeout ${LIMIT_S:-600}"
dtype=${DTYPE:-auto}
extra=()
[ "$dtype" = auto ] || extra=(--dtype "$dtype" --spec '{"mode": "s2d", "policy": "fixed", "k": 4}')
mkdir -p "$out"
run() {  # name, args...
  local name=$1; shift
  PYTHONPATH=$here "$py" "$here/tests/serve/scaleout_run.py" --check-greedy ${QUESTIONS:+--questions "$QUESTIONS"} \
    --reference-cache "$out/greedy_ref.json" --out "$out/$name.json" "$@" 2>"$out/$name.log" | tee -a "$out/summary.txt"
}
export -f run
export here py out QUESTIONS
case $phase in
  pair|all)
    $limit bash -c 'run two --replicas 2 --requests 96 && run one --replicas 1 --requests 96' ;;&
  scaledown|all)
    $limit bash -c "run scaledown-$dtype --replicas 2 --requests 64 --scale-down-at 15 ${extra[*]@Q}" ;;&
  faults|all)
    $limit bash -c "run kill-draft-$dtype --replicas 2 --requests 64 --kill draft --kill-at 10 ${extra[*]@Q} && \
      run kill-target-$dtype --replicas 2 --requests 64 --kill target-smollm2-135m-instruct --kill-at 10 ${extra[*]@Q}" ;;
  pair|scaledown) ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
