"""In-process twin of `s2d bench serve` at concurrency 1: the same 24 prompts (mixed Spec-Bench first turns, raw text
as /v1/completions encodes it), 64 tokens greedy, one after another; tok/s = completion tokens / wall seconds (prefill
included, as served). Usage: python scripts/serve_inprocess_twin.py <dtype> <mode>... (e.g. auto ar s2d)"""
import json, sys, time
from s2d_ray.config import EngineConfig
from s2d_ray.build import build_engine
from s2d_ray.bench.serve import mixed_prompts
from s2d_ray.core.engine import GenerationRequest
from s2d_ray.prompts import encode_prompt

prompts = mixed_prompts(None)[:24]
out = {}
for mode in sys.argv[2:]:
    b = build_engine(EngineConfig.model_validate({"spec": {"mode": mode}, "num_threads": 1, "target": {"dtype": sys.argv[1]}}))
    tok = b.target.tokenizer
    ids = [encode_prompt(tok, p, chat=False) for p in prompts]
    b.engine.generate([GenerationRequest("warm", ids[0], 16)])
    n, t0 = 0, time.perf_counter()
    for i, x in enumerate(ids):
        r = b.engine.generate([GenerationRequest(f"r{i}", x, 64, stop_token_ids=(tok.eos_token_id,))])[0]
        n += len(r.token_ids)
    dt = time.perf_counter() - t0
    out[mode] = {"tokens": n, "seconds": dt, "tok_s": n / dt}
    print(mode, json.dumps(out[mode]), flush=True)
