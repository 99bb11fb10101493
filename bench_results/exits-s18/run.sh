#!/usr/bin/env bash
# Issue 16: the committed draft against the stage-6 draft at step 6,000 (DRAFT6000), each calibrated on the same
# held-out greedy paths of each target (data/draftq/heldout), with the committed profiles' costs (--costs-from: the
# AVX512-BF16 host's bf16 grid, this AVX2 host's fp32 grid): adaptive exits against each exit alone, modelled.
# Both targets side by side (one core each). Run under /work/notes/quiet.sh.
# Other drafts, other sessions: OUT (bench_results/exits-s18), NEW (draft6000: the name of the other draft's rows),
# NEW_DRAFT (its directory; default $DRAFT6000), COMMITTED_DTYPES (bfloat16 float32: the dtypes the committed draft
# is calibrated in as well; bench_results/exits-s21/run.sh sets these).
cd /work/main
OUT=${OUT:-bench_results/exits-s18}
NEW=${NEW:-draft6000}
committed=s2d_ray/assets/drafts/smollm2-135m-s2d
for dt in bfloat16 float32; do
  sfx=$([[ $dt == float32 ]] && echo "" || echo ".$dt")
  for d in committed $NEW; do
    [[ $d == committed && " ${COMMITTED_DTYPES:-bfloat16 float32} " != *" $dt "* ]] && continue
    draft=$([[ $d == committed ]] && echo $committed || echo "${NEW_DRAFT:-${DRAFT6000:?}}")
    for t in smollm2-135m-instruct smollm2-135m-gsm8k; do
      c=$([[ $t == smollm2-135m-instruct ]] && echo 0 || echo 1)
      taskset -c $c .venv/bin/s2d calibrate --target $t --draft $draft --paths data/draftq/heldout/$t.jsonl \
        --dtype $dt --calibration off --costs-from $committed/calibration/$t$sfx.json --threads 1 \
        --out $OUT/$d/$t$sfx.json > $OUT/$d-$t$sfx.log 2>&1 &
    done
    wait
  done
done
