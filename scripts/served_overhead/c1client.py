"""Sequential streaming /v1/completions, N prompts, optional speculate flag; prints tok/s."""
import json, sys, time, httpx
from s2d_ray.bench.serve import mixed_prompts
spec = sys.argv[1] == "s2d"; n = int(sys.argv[2])
prompts = mixed_prompts(None)[:n]
toks, t0 = 0, time.perf_counter()
with httpx.Client(timeout=300) as c:
    for p in prompts:
        body = {"model": "smollm2-135m-instruct", "prompt": p, "max_tokens": 64, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        if not spec: body["speculate"] = False
        with c.stream("POST", "http://127.0.0.1:8000/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    d = json.loads(line[6:])
                    if d.get("usage"): toks += d["usage"]["completion_tokens"]
dt = time.perf_counter() - t0
print(json.dumps({"mode": sys.argv[1], "tokens": toks, "seconds": dt, "tok_s": toks / dt}))
