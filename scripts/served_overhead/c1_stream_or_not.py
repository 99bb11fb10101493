"""Sequential /v1/completions (concurrency 1) of the serve bench's first N prompts, 64 tokens greedy, streaming or
not, S2D or plain (`speculate: false`) on a served app at 127.0.0.1:8000: tok/s. A light client (no per-chunk
timing), so streamed and whole responses compare. Usage: python c1_stream_or_not.py s2d|ar N stream|non"""
import json, sys, time, httpx
from s2d_ray.bench.serve import mixed_prompts
mode, n, stream = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "stream"
prompts = mixed_prompts(None)[:n]
toks, t0 = 0, time.perf_counter()
with httpx.Client(timeout=300) as c:
    for p in prompts:
        body = {"model": "smollm2-135m-instruct", "prompt": p, "max_tokens": 64, "temperature": 0, "stream": stream}
        if stream: body["stream_options"] = {"include_usage": True}
        if mode == "ar": body["speculate"] = False
        if stream:
            with c.stream("POST", "http://127.0.0.1:8000/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        d = json.loads(line[6:])
                        if d.get("usage"): toks += d["usage"]["completion_tokens"]
        else:
            toks += c.post("http://127.0.0.1:8000/v1/completions", json=body).json()["usage"]["completion_tokens"]
dt = time.perf_counter() - t0
print(json.dumps({"mode": mode, "stream": stream, "tokens": toks, "seconds": round(dt, 2), "tok_s": round(toks / dt, 2)}), flush=True)
