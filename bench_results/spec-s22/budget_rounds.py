"""The README prompt in-process (build_engine defaults: fp32 here, all cores, the committed profile), then where the
budget spent its rounds: kind -> [rounds, seconds, tokens, draft seconds], and its learned depth cost (depth_s).
Usage: S2D_LINEAR_KERNEL=several|auto .venv/bin/python bench_results/spec-s22/budget_rounds.py"""
import sys, json
from s2d_ray.build import build_engine
from s2d_ray.config import EngineConfig, TargetConfig
from s2d_ray.core.engine import GenerationRequest
import inspect
cfg = EngineConfig(target=TargetConfig(name="smollm2-135m-instruct"))
b = build_engine(cfg)
tok = b.target.tokenizer
ids = tok.apply_chat_template([{"role": "user", "content": "Explain speculative decoding in two sentences."}], add_generation_prompt=True)
ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
print(inspect.signature(GenerationRequest))
r = b.engine.generate([GenerationRequest("a", list(ids), 96, stop_token_ids=(tok.eos_token_id,))])[0]; print(len(r.token_ids))
bud = b.engine.budget
print("scale", round(bud.scale, 3), "first_hit", bud._first_hit, "depth_s", bud._depth_s, "round_s", bud._round_s, "tokens", bud._round_tokens)
print({k: [round(x, 3) for x in v] for k, v in bud.spent.items()})
print(bud.measured())
