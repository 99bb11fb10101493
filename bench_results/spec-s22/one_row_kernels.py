"""A decode step (one row after a 256-token prefix) of the target, SmolLM2-135M-Instruct fp32, with the kernels
S2D_LINEAR_KERNEL names (`several`: session 21's several-row packing only; `auto`: plus the one-row MKL copies where
they measured faster). One kernel per process (a process packs each Linear once); run.sh alternates processes.
Prints the best-of-15 step time and the logits' checksum. Usage: one_row_kernels.py THREADS"""
import sys, time, torch
from s2d_ray.build import load_target
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core import stack as st
from s2d_ray.config import EngineConfig, TargetConfig
from s2d_ray.core.types import ScoreRequest
threads = int(sys.argv[1])
torch.set_num_threads(threads)
t = load_target(EngineConfig(target=TargetConfig(name="smollm2-135m-instruct", dtype="float32")))
ids = t.tokenizer("The quick brown fox jumps over the lazy dog. " * 25)["input_ids"][:256]
v = TargetVerifier(t.model)
best, lg = 1e9, None
for r in range(15):
    v.score([ScoreRequest("a", ids, 1)])
    t0 = time.perf_counter(); lg = v.score([ScoreRequest("a", ids + [100 + r], 1)])[0]
    best = min(best, time.perf_counter() - t0)
    v.release("a")
print(f"kernel={st.LINEAR_KERNEL} threads={threads} packed={v.stack.packed_linears} "
      f"one_row={v.stack.one_row_linears} step_ms={best * 1e3:.2f} argmax={int(lg[-1].argmax())} "
      f"sum={lg.double().sum().item():.6f}")
