"""One-row decode step and a 32-position pass of SmolLM2-135M, bf16 and fp32, 1 thread: median ms."""
import os, sys, time, statistics, torch
sys.path.insert(0, "/work/main")
torch.set_num_threads(int(os.environ.get("T", "1")))
from s2d_ray.models.loader import load_model
res = {}
for dt in (torch.bfloat16, torch.float32):
    model = load_model("smollm2-135m-instruct", dtype=dt).model
    model.eval()
    with torch.no_grad():
        ids = torch.randint(0, 1000, (1, 256))
        out = model(ids, use_cache=True)
        pkv = out.past_key_values
        for n in (1, 32):
            ts = []
            for r in range(12):
                x = torch.randint(0, 1000, (1, n))
                t = time.perf_counter()
                model(x, past_key_values=pkv, use_cache=True)
                ts.append(1000 * (time.perf_counter() - t))
                pkv.crop(-n)
            res[(str(dt), n)] = round(statistics.median(ts[2:]), 1)
print(os.environ.get("ONEDNN_MAX_CPU_ISA", "default"), res)
