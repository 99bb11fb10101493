"""What prompts cost in-process: the 24 serve-bench prompts filled one at a time, the longest alone, and a torch
profile of the longest (where a prompt pass goes). Usage: QUESTIONS=question.jsonl python scripts/served_overhead/prefill_cost.py"""
import os, time, torch
from pathlib import Path
from s2d_ray.config import EngineConfig
from s2d_ray.build import build_engine
from s2d_ray.bench.serve import mixed_prompts
from s2d_ray.core.engine import GenerationRequest
from s2d_ray.prompts import encode_prompt
from torch.profiler import ProfilerActivity, profile
prompts = mixed_prompts(Path(os.environ['QUESTIONS']))[:24]
b = build_engine(EngineConfig.model_validate({"spec": {"mode": "ar"}, "num_threads": 1, "target": {"dtype": "auto"}}))
eng = b.engine
ids = [encode_prompt(b.target.tokenizer, p, chat=False) for p in prompts]
print("prompt lens", sorted(len(x) for x in ids), "sum", sum(len(x) for x in ids))
def pre(sel, tag):
    t = time.perf_counter()
    for i in sel: eng.add_request(GenerationRequest(f"{tag}{i}", ids[i], 2))
    eng.step()
    dt = time.perf_counter() - t
    for i in sel: eng.abort(f"{tag}{i}")
    return dt
pre([0], "w")
long = max(range(24), key=lambda i: len(ids[i]))
for rep in range(2):
    print("long %d tok: %.3f s" % (len(ids[long]), pre([long], f"l{rep}")))
    tot = sum(pre([i], f"a{rep}") for i in range(24))
    print("all 24 one by one: %.2f s" % tot)
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    pre([long], "p")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=14))
