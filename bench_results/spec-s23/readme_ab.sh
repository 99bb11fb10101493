#!/usr/bin/env bash
# The README's first command (default flags: dtype auto = fp32 here, all cores), S2D and `--mode ar`, alternated REPS
# times, code at HEAD (the budget learning a depth's cost from warm rounds, joining rounds timed). Run alone.
cd "$(dirname "$0")/../.."
P="Explain speculative decoding in two sentences."
for rep in $(seq "${REPS:-5}"); do for mode in s2d ar; do
  .venv/bin/s2d generate --chat --prompt "$P" --mode $mode --json 2>/dev/null |
    python3 -c "import json,sys; m=json.loads(sys.stdin.readline())['metrics']; print('$rep $mode', round(m['tokens_per_second'],2), m['num_generated_tokens'], round(m['mean_acceptance_length'],2))"
done; done
