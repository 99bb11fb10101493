cd /work/main
for i in 1 2; do
.venv/bin/python /tmp/cal14/isa.py
ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 .venv/bin/python /tmp/cal14/isa.py
done
T=2 .venv/bin/python /tmp/cal14/isa.py
T=2 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 .venv/bin/python /tmp/cal14/isa.py
