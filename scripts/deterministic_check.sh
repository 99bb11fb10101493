#!/usr/bin/env bash
# Deterministic mode's cost and equality (BENCHMARKS.md): bf16 `ar` and `s2d` with the default and the deterministic
# kernels on the last 8 held-out instructions, at batch 1 and 8, two runs; then tok/s per run and how many S2D outputs
# equal plain decoding's, and whether each mode repeats itself across runs and batch sizes. Times things: run it on
# an otherwise idle machine.   scripts/deterministic_check.sh OUT_DIR [TOKENS (128)] [RUNS (2)]
set -eu
out=${1:?usage: scripts/deterministic_check.sh OUT_DIR [TOKENS] [RUNS]}; tokens=${2:-128}; runs=${3:-2}
py=${PYTHON:-.venv/bin/python}
export HF_HUB_OFFLINE=1
mkdir -p "$out"
tail -n 8 data/draftq/heldout/smollm2-135m-instruct.jsonl |
  "$py" -c "import sys,json; [print(json.dumps({'prompt': json.loads(l)['split_key']})) for l in sys.stdin]" \
  > "$out/prompts.jsonl"
for run in $(seq 1 "$runs"); do for det in default deterministic; do for mode in ar s2d; do for bs in 1 8; do
  "$py" -m s2d_ray.cli generate --prompt-file "$out/prompts.jsonl" --chat --max-new-tokens "$tokens" \
    --dtype bfloat16 --mode $mode --batch-size $bs $([ $det = deterministic ] && echo --deterministic) --json \
    > "$out/$det-$mode-b$bs-r$run.jsonl" 2>/dev/null
done; done; done; done
"$py" - "$out" <<'PY' | tee "$out/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {f.stem: [json.loads(line) for line in f.read_text().splitlines()] for f in sorted(out.glob("*-r*.jsonl"))}
def tps(rs, bs):  # batch 1: prompts one after another; batch 8: all at once
    secs = [r["metrics"]["total_seconds"] for r in rs]
    return sum(r["metrics"]["num_generated_tokens"] for r in rs) / (sum(secs) if bs == "b1" else max(secs))
for det in ("default", "deterministic"):
    for bs in sorted({k.split("-")[2] for k in rows}):
        for run in sorted({k.split("-")[3] for k in rows}):
            ar, s2d = rows[f"{det}-ar-{bs}-{run}"], rows[f"{det}-s2d-{bs}-{run}"]
            same = sum(a["token_ids"] == s["token_ids"] for a, s in zip(ar, s2d))
            print(f"{det} {bs} {run}: ar {tps(ar, bs):.2f} tok/s, s2d {tps(s2d, bs):.2f} tok/s, s2d == ar {same}/{len(ar)}")
    for mode in ("ar", "s2d"):
        keys = sorted(k for k in rows if k.startswith(f"{det}-{mode}-"))
        ref = [r["token_ids"] for r in rows[keys[0]]]
        print(f"{det} {mode}: identical across {len(keys)} runs x batch sizes: "
              f"{all([r['token_ids'] for r in rows[k]] == ref for k in keys)}")
PY
