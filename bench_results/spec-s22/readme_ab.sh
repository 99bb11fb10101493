#!/usr/bin/env bash
# The README's first command (default flags: dtype auto = fp32 here, all cores), S2D and `--mode ar`, with session
# 21's kernels (S2D_LINEAR_KERNEL=several) and with the one-row heads (auto), alternated REPS times (run alone).
cd "$(dirname "$0")/../.."
P="Explain speculative decoding in two sentences."
for rep in $(seq "${REPS:-3}"); do for k in several auto; do for mode in s2d ar; do
  S2D_LINEAR_KERNEL=$k .venv/bin/s2d generate --chat --prompt "$P" --mode $mode --json 2>/dev/null |
    python3 -c "import json,sys; m=json.loads(sys.stdin.readline())['metrics']; print('$rep $k $mode', round(m['tokens_per_second'],2), m['num_generated_tokens'], round(m['mean_acceptance_length'],2))"
done; done; done
