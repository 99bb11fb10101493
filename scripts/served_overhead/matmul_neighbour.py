"""Does a bf16 projection on one core slow down when the other core works? One thread, 20 weights of the MLP's shape
(1536x576, ~35 MB together: they stream from memory, as a 135M model's do), 4 rows, best of 3 runs of 200 passes.
Run it alone, then beside a pure ALU loop, then beside a second copy of itself (session 25: 0.55 s, 0.55 s, 0.82 s
on the Intel Xeon with AMX: a neighbour's matmuls cost +49%, a neighbour's integer loop nothing).
Usage: python scripts/served_overhead/matmul_neighbour.py LABEL"""
import sys
import time

import torch

torch.set_num_threads(1)
weights = [torch.randn(1536, 576).bfloat16() for _ in range(20)]
x = torch.randn(4, 576).bfloat16()


def run() -> float:
    start = time.perf_counter()
    for _ in range(200):
        for w in weights:
            torch.nn.functional.linear(x, w)
    return time.perf_counter() - start


run()
print(sys.argv[1] if len(sys.argv) > 1 else "alone", round(min(run() for _ in range(3)), 3))
