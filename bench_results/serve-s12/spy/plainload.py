import json, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
sys.path.insert(0, "/work/main")
from s2d_ray.bench.serve import mixed_prompts
prompts = mixed_prompts(None)[:24] * int(sys.argv[1])
def one(p):
    body = json.dumps({"model": "smollm2-135m-instruct", "prompt": p, "max_tokens": 64, "temperature": 0,
                       "speculate": sys.argv[2] == "1"}).encode()
    r = urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:8000/v1/completions", body,
                                                      {"Content-Type": "application/json"}), timeout=300)
    return json.loads(r.read())["usage"]["completion_tokens"]
t = time.perf_counter()
with ThreadPoolExecutor(int(sys.argv[3]) if len(sys.argv) > 3 else 8) as ex:
    n = sum(ex.map(one, prompts))
print("tokens", n, "s", round(time.perf_counter() - t, 1), "tok/s", round(n / (time.perf_counter() - t), 1))
