cd /work/main
run() { # core name calib out
  taskset -c $1 .venv/bin/s2d bench spec --target smollm2-135m-instruct --dtype bfloat16 --threads 1 --per-category 2 \
    --max-new-tokens 128 --methods hf-generate,s2d --no-progress --calibration $3 --out /tmp/cal14/ab-$4 > /tmp/cal14/ab-$4.log 2>&1
}
run 0 amd auto r1-amd & run 1 here /tmp/cal14/bf16-new.json r1-here & wait
run 1 amd auto r2-amd & run 0 here /tmp/cal14/bf16-new.json r2-here & wait
for r in r1-amd r1-here r2-amd r2-here; do echo $r; grep -A4 "overall" /tmp/cal14/ab-$r.log | tail -n 1; done
