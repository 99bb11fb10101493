"""In-process twin of `s2d bench serve` at concurrency c: the same 24 prompts, 64 tokens greedy, continuous batching
the way the router does it (s2d_ray/bench/twin.py, which `s2d bench serve --twin` runs alternately with the served
levels). Tells whether served decoding loses to Serve or to the workload itself.
Usage: [PROMPTS=24] [WIDE=2] [STEPS=4] python scripts/served_overhead/inproc_load.py <dtype> <mode> <c>...
(WIDE: wide_threads; STEPS: the engine's plain_steps, greedy steps per call in rounds without drafts, as the router
sets it; the Spec-Bench questions from QUESTIONS=path, else ../shared next to the checkout). Session 13's TURN_MS
(a delay before a client's next request) is gone: the twin's clients send at once, as `--twin` compares them."""
import json, os, sys
from pathlib import Path
from s2d_ray.config import EngineConfig
from s2d_ray.build import build_engine
from s2d_ray.bench.serve import mixed_prompts
from s2d_ray.bench.twin import Twin, run_twin_level
from s2d_ray.core.engine import GenerationRequest
from s2d_ray.prompts import encode_prompt

prompts = mixed_prompts(Path(os.environ['QUESTIONS']) if os.environ.get('QUESTIONS') else None)[:int(os.environ.get('PROMPTS', 24))]
b = build_engine(EngineConfig.model_validate({"spec": {"mode": sys.argv[2]}, "num_threads": 1,
                                              "wide_threads": int(os.environ.get("WIDE", 0)) or None,
                                              "target": {"dtype": sys.argv[1]}}))
tok = b.target.tokenizer
b.engine.plain_steps = int(os.environ.get("STEPS", 1))
twin = Twin(b, [encode_prompt(tok, p, chat=False) for p in prompts], (tok.eos_token_id,))
b.engine.generate([GenerationRequest("warm", twin.prompt_ids[0], 16)])
for c in map(int, sys.argv[3:]):
    r = run_twin_level(twin, c, len(prompts), 64)
    print(json.dumps({"c": c, "tokens": r["output_tokens"], "seconds": round(r["wall_seconds"], 2),
                      "tok_s": round(r["throughput_tokens_per_s"], 1), "rounds": r["rounds"],
                      "prompt_rounds": r["prompt_rounds"], "prompt_round_s": round(r["prompt_round_s"], 2),
                      "decode_round_s": round(r["decode_round_s"], 2),
                      "decode_ms_by_rows": {k: round(v, 1) for k, v in r["decode_ms_by_rows"].items()},
                      "prompt_detail": r["prompt_detail"],  # (s, rows, new prompt tokens)
                      # the budget's rounds by kind in this level: [rounds, s, tokens, draft s]
                      "spent": {k: [v["rounds"], round(v["seconds"], 2), v["tokens"], round(v["draft_seconds"], 2)]
                                for k, v in sorted(r["spent"].items())} if r["spent"] is not None else None}),
          flush=True)
