"""ar (engine plain decoding) vs transformers generate, fp32, one thread: time per token, then a cProfile of ar."""
import cProfile, json, pstats, sys, time, torch
sys.path.insert(0, ".")
from s2d_ray.config import EngineConfig, TargetConfig
from s2d_ray.build import load_target, with_resolved_dtype
from s2d_ray.bench.methods import HFGenerate, EngineMethod, with_mode
from s2d_ray.core.types import SamplingParams
name = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 128
cfg = EngineConfig(target=TargetConfig(name=name, dtype="float32"), num_threads=1)
torch.set_num_threads(1)
target = load_target(cfg)
tok = target.tokenizer
qs = [json.loads(l) for l in open("../shared/data/spec_bench/question.jsonl")][:200:40]
prompts = [tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True) for q in qs]
prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
hf = HFGenerate(target.model, tok.eos_token_id)
ar = EngineMethod(with_mode(cfg, "ar"), target, tok.eos_token_id)
params = SamplingParams()
for p in prompts[:1]:
    hf.generate(p, 8, params); ar.generate(p, 8, params)
res = {"hf": [0.0, 0], "ar": [0.0, 0]}
for p in prompts:
    for nm, m in (("hf", hf), ("ar", ar)):
        t = time.perf_counter(); out, _ = m.generate(p, N, params); res[nm][0] += time.perf_counter() - t; res[nm][1] += len(out)
print({k: f"{1000 * s / n:.1f} ms/token ({n} tokens)" for k, (s, n) in res.items()}, flush=True)
if len(sys.argv) > 3: sys.exit(0)
pr = cProfile.Profile(); pr.enable()
for p in prompts[:2]:
    ar.generate(p, N, params)
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(25)
if len(sys.argv) > 3: sys.exit(0)
pr = cProfile.Profile(); pr.enable()
for p in prompts[:2]:
    hf.generate(p, N, params)
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(15)
