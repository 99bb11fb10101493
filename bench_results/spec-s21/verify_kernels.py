"""One-row verification cost by positions n with the stock kernels and with several-row projections packed
(core/linear.py), in one process, SmolLM2-135M-Instruct fp32, one thread, a 256-token prefix; also whether the
logits agree. Run alone: .venv/bin/python bench_results/spec-s21/verify_kernels.py"""
import time, torch, sys
from s2d_ray.build import load_target
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core import stack as st
from s2d_ray.config import EngineConfig, TargetConfig
from s2d_ray.core.types import ScoreRequest
torch.set_num_threads(1)
cfg = EngineConfig(target=TargetConfig(name="smollm2-135m-instruct", dtype="float32"))
t = load_target(cfg)
ids = t.tokenizer("The quick brown fox jumps over the lazy dog. " * 25)["input_ids"][:256]
res = {}
for kern in ("stock", "auto"):
    st.LINEAR_KERNEL = kern
    v = TargetVerifier(t.model)
    print(kern, "packed", v.stack.packed_linears)
    out = {}
    for n in (1, 2, 4, 8, 16):
        best = 1e9
        for r in range(7):
            seq = ids + [100 + r] * n
            v.score([ScoreRequest("a", ids, 1)])  # prefill
            t0 = time.perf_counter(); lg = v.score([ScoreRequest("a", seq, n)])[0]; best = min(best, time.perf_counter() - t0)
        out[n] = (best * 1e3, lg)
    res[kern] = out
    print(kern, {n: round(o[0], 1) for n, o in out.items()})
for n in res["stock"]:
    a, b = res["stock"][n][1], res["auto"][n][1]
    print(n, "max|diff|", (a - b).abs().max().item(), "argmax equal", bool((a.argmax(-1) == b.argmax(-1)).all()))
