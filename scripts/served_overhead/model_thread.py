"""Does a replica's model thread cost anything? In-process c1 twin (bf16, 1 thread, wide passes on 2); with THREAD=1 every verifier.score and drafter.propose runs on one worker thread (like a
replica's ModelThread) instead of the main thread. Splits time by propose / score."""
import json, os, sys, time, collections
from concurrent.futures import ThreadPoolExecutor
import torch
from s2d_ray.config import EngineConfig
from s2d_ray.build import build_engine
from s2d_ray.bench.serve import mixed_prompts
from s2d_ray.core.engine import GenerationRequest
from s2d_ray.prompts import encode_prompt

prompts = mixed_prompts(None)[:24]
b = build_engine(EngineConfig.model_validate({"spec": {"mode": "s2d"}, "num_threads": 1, "wide_threads": 2,
                                              "target": {"dtype": "bfloat16"}}))
tok, eng = b.target.tokenizer, b.engine
if os.environ.get("LIMIT"):  # the target replica's KV bounds: LIMIT=rows,slots (local.yaml: 32,8192)
    from s2d_ray.core.stack import limit_rows
    rows, slots = map(int, os.environ["LIMIT"].split(","))
    limit_rows(eng.verifier, rows, slots)
pool = ThreadPoolExecutor(1)
if os.environ.get("THREAD") == "1":
    pool.submit(torch.set_num_threads, 1).result()
acc = collections.defaultdict(float); cnt = collections.Counter(); cpu = collections.defaultdict(float)
def wrap(obj, name, key):
    f = getattr(obj, name)
    def timed(*a, **k):
        c = time.thread_time(); r = f(*a, **k); cpu[key] += time.thread_time() - c; return r
    def g(*a, **k):
        t = time.perf_counter()
        r = pool.submit(timed, *a, **k).result() if os.environ.get("THREAD") == "1" else timed(*a, **k)
        acc[key] += time.perf_counter() - t; cnt[key] += 1; return r
    setattr(obj, name, g)
draft = getattr(eng.drafter, "draft", None)
wrap(draft if draft is not None else eng.drafter, "propose", "propose"); wrap(eng.verifier, "score", "score")
ids = [encode_prompt(tok, p, chat=False) for p in prompts]
eng.generate([GenerationRequest("warm", ids[0], 16)])
acc.clear(); cnt.clear(); cpu.clear()
todo = [GenerationRequest(f"r{i}", x, 64, stop_token_ids=(tok.eos_token_id,)) for i, x in enumerate(ids)]
n, t0 = 0, time.perf_counter()
while todo or eng.has_unfinished:
    if todo and not eng.seqs:
        eng.add_request(todo.pop(0))
    n += sum(len(o.new_tokens) for o in eng.step())
dt = time.perf_counter() - t0
print(json.dumps({"thread": os.environ.get("THREAD"), "limit": os.environ.get("LIMIT"), "tokens": n, "s": round(dt, 2), "tok_s": round(n / dt, 1),
                  **{k: [cnt[k], round(1e3 * acc[k] / max(cnt[k], 1), 1), round(1e3 * cpu[k] / max(cnt[k], 1), 1)] for k in acc}}))
