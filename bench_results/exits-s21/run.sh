#!/usr/bin/env bash
# Issue 16, session 21: the stage-6 draft at its last step (10,000; data/draftq/drafts/stage5) against the committed
# draft, each calibrated on the same held-out greedy paths of each target (data/draftq/heldout), with the committed
# profiles' costs (--costs-from: the AVX512-BF16 host's bf16 grid; this AVX2 host's fp32 grid, re-measured in
# session 20): adaptive exits against each exit alone, modelled. The committed draft's bf16 rows are unchanged from
# bench_results/exits-s18 (same grid), so only its fp32 rows are redone. Both targets side by side (one core each).
# Run alone (nothing else of ours on the two cores).
cd /work/main
OUT=bench_results/exits-s21
committed=s2d_ray/assets/drafts/smollm2-135m-s2d
final=${FINAL:-data/draftq/drafts/stage5}
for dt in float32 bfloat16; do
  sfx=$([[ $dt == float32 ]] && echo "" || echo ".$dt")
  for d in step10000 committed; do
    [[ $d == committed && $dt == bfloat16 ]] && continue
    draft=$([[ $d == committed ]] && echo $committed || echo "$final")
    for t in smollm2-135m-instruct smollm2-135m-gsm8k; do
      c=$([[ $t == smollm2-135m-instruct ]] && echo 0 || echo 1)
      taskset -c $c .venv/bin/s2d calibrate --target $t --draft $draft --paths data/draftq/heldout/$t.jsonl \
        --dtype $dt --calibration off --costs-from $committed/calibration/$t$sfx.json --threads 1 \
        --out $OUT/$d/$t$sfx.json > $OUT/$d-$t$sfx.log 2>&1 &
    done
    wait
  done
done
