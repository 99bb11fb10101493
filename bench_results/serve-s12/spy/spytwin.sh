cd /work/main
export HF_HUB_OFFLINE=1 QUESTIONS=/work/shared/data/spec_bench/question.jsonl WIDE=2 PYTHONPATH=/work/main
O=/work/main/bench_results/serve-s12/spy
.venv/bin/py-spy record -r 100 -f raw -o $O/twin-plain-c8.txt --nonblocking -- .venv/bin/python scripts/served_overhead/inproc_load.py auto ar 8 > $O/twin-plain-c8.log 2>&1
