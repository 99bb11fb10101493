"""What one plain decode round costs in-process by rows and context length (the serve-bench prompts: a few of ~700
tokens among short ones), and a torch profile of 8 rows over mixed contexts: where a batch-8 round goes.
Usage: [QUESTIONS=question.jsonl] python scripts/served_overhead/decode_rows.py"""
import os, time
from pathlib import Path
from s2d_ray.config import EngineConfig
from s2d_ray.build import build_engine
from s2d_ray.bench.serve import mixed_prompts
from s2d_ray.core.engine import GenerationRequest
from s2d_ray.prompts import encode_prompt
from torch.profiler import ProfilerActivity, profile

prompts = mixed_prompts(Path(os.environ['QUESTIONS']) if os.environ.get('QUESTIONS') else None)[:24]
b = build_engine(EngineConfig.model_validate({"spec": {"mode": "ar"}, "num_threads": 1, "target": {"dtype": "auto"}}))
eng = b.engine
ids = [encode_prompt(b.target.tokenizer, p, chat=False) for p in prompts]


def median_round_ms(sel: list[int], tag: str, n: int = 12) -> float:
    for i in sel:
        eng.add_request(GenerationRequest(f"{tag}{i}", ids[i], 200))
    eng.step(), eng.step()  # prompts, first decode
    times = []
    for _ in range(n):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    for i in sel:
        eng.abort(f"{tag}{i}")
    return round(1e3 * sorted(times)[n // 2], 1)


short = [i for i, x in enumerate(ids) if len(x) < 70]
mixed = list(range(8))
print("prompt tokens of rows 0-7:", [len(ids[i]) for i in mixed])
for name, sel in [("1 short", short[:1]), ("1 long", [max(mixed, key=lambda i: len(ids[i]))]),
                  ("2 short", short[:2]), ("4 short", short[:4]), ("8 short", short[:8]), ("8 mixed", mixed)]:
    print(f"{name}: {median_round_ms(sel, name.replace(' ', ''))} ms", flush=True)
for i in mixed:
    eng.add_request(GenerationRequest(f"p{i}", ids[i], 200))
eng.step(), eng.step()
with profile(activities=[ProfilerActivity.CPU], record_shapes=bool(os.environ.get("SHAPES"))) as prof:
    for _ in range(5):
        eng.step()
print("5 rounds of 8 mixed rows:")
print(prof.key_averages(group_by_input_shape=bool(os.environ.get("SHAPES"))).table(sort_by="self_cpu_time_total", row_limit=int(os.environ.get("ROWS", 8))))
