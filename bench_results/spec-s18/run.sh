#!/usr/bin/env bash
# Session 18, an AMD EPYC with AVX2 only (no AVX512, no native bf16: `--dtype auto` resolves to float32). In-process
# Spec-Bench, both targets side by side (one core each), 1 thread, 2 questions a category, 128 tokens, methods
# interleaved per question. Run under /work/notes/quiet.sh (the stage-6 training paused).
#   RUN=committed  the committed draft and profiles (this host's fp32 grid added by `calibrate --costs-only`)
#   RUN=draft6000  issue 16's stage-6 draft at step 6,000 (DRAFT), calibrated here in fp32 first: the adaptive exits
#                  against each fixed exit under the product's tree (T) and under a chain (C), same auto policy
#   TAG: a suffix for the output directories (a rerun of the same RUN after a change)
#   RUN=bf16       hf-generate in fp32 against bf16 on one question a category, 32 tokens (is bf16 slower here?)
cd /work/main
OUT=bench_results/spec-s18
T=tree4+lookup+auto+k1+n24; C=chain+auto
case ${RUN:?} in
  committed) M=hf-generate,ar,hf-prompt-lookup,lookup,s2d; args=(--per-category 2 --max-new-tokens 128) ;;
  draft6000) M=hf-generate,ar,lookup,exit:2:$T,exit:4:$T,exit:6:$T,s2d:$T,exit:2:$C,exit:6:$C,s2d:$C
             args=(--per-category 2 --max-new-tokens 128 --draft "${DRAFT:?}") ;;
  bf16) M=hf-generate,hf-generate:bfloat16; args=(--per-category 1 --max-new-tokens 32) ;;
esac
core() { [[ $1 == smollm2-135m-instruct ]] && echo 0 || echo 1; }
targets=(smollm2-135m-instruct smollm2-135m-gsm8k)
if [[ $RUN == draft6000 ]]; then  # calibrate first, both targets side by side (as the benchmark then runs)
  for t in "${targets[@]}"; do
    [[ -f $DRAFT/calibration/$t.json ]] || taskset -c $(core $t) .venv/bin/s2d calibrate --target $t --draft "$DRAFT" \
      --paths data/draftq/heldout/$t.jsonl --dtype float32 --calibration off --out "$DRAFT/calibration/$t.json" \
      --threads 1 > $OUT/$RUN-$t.cal.log 2>&1 &
  done
  wait
fi
for t in "${targets[@]}"; do
  taskset -c $(core $t) .venv/bin/s2d bench spec --target $t --dtype float32 --threads 1 "${args[@]}" --methods $M \
    --no-progress --out $OUT/$RUN$TAG-$t > $OUT/$RUN$TAG-$t.log 2>&1 &
done
wait
