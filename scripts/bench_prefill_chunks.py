"""Time to first token of one long prompt in-process, prefill in one pass (chunk 0) against passes of 256 positions
(the default), for `ar` and `s2d`, bf16 where fast (dtype auto), 1 thread. Usage: python scripts/bench_prefill_chunks.py"""
import time, torch
from s2d_ray.config import EngineConfig
from s2d_ray.build import build_engine
from s2d_ray.core.engine import GenerationRequest
torch.set_num_threads(1)
for mode in ("ar", "s2d"):
    b = build_engine(EngineConfig.model_validate({"spec": {"mode": mode}, "num_threads": 1, "target": {"dtype": "auto"}}))
    for chunk in (0, 256):
        b.engine.verifier.prefill_chunk = chunk
        if b.engine.drafter is not None:
            d = getattr(b.engine.drafter, "draft", b.engine.drafter)
            for x in (b.engine.drafter, d):
                if hasattr(x, "prefill_chunk"): x.prefill_chunk = chunk
        for n in (500, 1000):
            ids = torch.randint(100, 20000, (n,)).tolist()
            ts = []
            for i in range(2):
                t = time.perf_counter(); b.engine.generate([GenerationRequest(f"p{n}-{i}-{chunk}", ids, 1)]); ts.append(time.perf_counter() - t)
            print(mode, "chunk", chunk, n, "TTFT ms", [round(1e3 * x) for x in ts], flush=True)
