"""Per-request time outside the engine, served at concurrency 1 (session 28): each streamed request's client latency
against the engine's `total_seconds` (admission to finish, from the last chunk's metrics), its TTFT against the
engine's `time_to_first_token_seconds`, and the client's gap between requests. The 24 prompts of the serve bench, 64
tokens greedy, REPS passes. Usage (an app serving local.yaml on :8000):
QUESTIONS=.../question.jsonl python scripts/served_overhead/request_overhead.py"""
import json, os, time
import httpx
from s2d_ray.bench.serve import mixed_prompts
from pathlib import Path

prompts = mixed_prompts(Path(os.environ["QUESTIONS"]))[:24]
url = "http://127.0.0.1:8000/v1/completions"
rows = []
with httpx.Client(timeout=120) as client:
    for rep in range(int(os.environ.get("REPS", 2))):
        t_prev_end = None
        for p in prompts:
            body = {"model": "smollm2-135m-instruct", "prompt": p, "max_tokens": 64, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            first = None; metrics = None
            with client.stream("POST", url, json=body) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    d = json.loads(line[6:])
                    if first is None and d.get("choices"):
                        first = time.perf_counter() - t0
                    if d.get("metrics"):
                        metrics = d["metrics"]["speculative_decoding"]
            t1 = time.perf_counter()
            rows.append({"rep": rep, "latency": t1 - t0, "ttft": first, "total": metrics["total_seconds"],
                         "first": metrics["time_to_first_token_seconds"], "gap": None if t_prev_end is None else t0 - t_prev_end})
            t_prev_end = t1
for rep in sorted({r["rep"] for r in rows}):
    rr = [r for r in rows if r["rep"] == rep]
    lat = sum(r["latency"] for r in rr); tot = sum(r["total"] for r in rr)
    print(f"rep {rep}: sum latency {lat:.2f} s, engine total {tot:.2f} s, outside {1e3*(lat-tot)/len(rr):.1f} ms/request; "
          f"ttft - engine first {1e3*sum(r['ttft']-r['first'] for r in rr)/len(rr):.1f} ms; "
          f"client gap {1e3*sum(r['gap'] or 0 for r in rr)/(len(rr)-1):.2f} ms")
