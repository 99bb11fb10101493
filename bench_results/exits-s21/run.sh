#!/usr/bin/env bash
# Issue 16, session 21: the stage-6 draft at its last step (10,000; data/draftq/drafts/stage5) against the committed
# draft, each calibrated on the same held-out greedy paths of each target (data/draftq/heldout), with the committed
# profiles' costs (--costs-from: the AVX512-BF16 host's bf16 grid; this AVX2 host's fp32 grid, re-measured in
# session 20): adaptive exits against each exit alone, modelled. The committed draft's bf16 rows are unchanged from
# bench_results/exits-s18 (same grid), so only its fp32 rows are redone. Both targets side by side (one core each).
# Run alone (nothing else of ours on the two cores). The same calibrations as session 18's script, other drafts:
OUT=bench_results/exits-s21 NEW=step10000 NEW_DRAFT=${FINAL:-data/draftq/drafts/stage5} COMMITTED_DTYPES=float32 \
  exec bash /work/main/bench_results/exits-s18/run.sh
