"""In-process twin of `s2d bench serve` at concurrency c: the same 24 prompts, 64 tokens greedy, continuous batching
the way the router does it (a request joins between rounds while fewer than c run). tok/s = completion tokens / wall;
per round: seconds, rows, prompt rows. Tells whether served plain loses at c8 to Serve or to the workload itself.
Usage: [PROMPTS=24] [WIDE=2] [STEPS=4] [TURN_MS=30] python scripts/served_overhead/inproc_load.py <dtype> <mode> <c>... (WIDE: wide_threads; STEPS: the engine's plain_steps, greedy steps per call in rounds without drafts, as the router sets it; TURN_MS: a client's next request arrives this long after its last one finished, as an HTTP client's does (default 0); the Spec-Bench questions from QUESTIONS=path,
else ../shared next to the checkout)"""
import json, os, sys, time
from pathlib import Path
from s2d_ray.config import EngineConfig
from s2d_ray.build import build_engine
from s2d_ray.bench.serve import mixed_prompts
from s2d_ray.core.engine import GenerationRequest
from s2d_ray.prompts import encode_prompt

prompts = mixed_prompts(Path(os.environ['QUESTIONS']) if os.environ.get('QUESTIONS') else None)[:int(os.environ.get('PROMPTS', 24))]
b = build_engine(EngineConfig.model_validate({"spec": {"mode": sys.argv[2]}, "num_threads": 1,
                                              "wide_threads": int(os.environ.get("WIDE", 0)) or None,
                                              "target": {"dtype": sys.argv[1]}}))
tok, eng = b.target.tokenizer, b.engine
eng.plain_steps = int(os.environ.get("STEPS", 1))
ids = [encode_prompt(tok, p, chat=False) for p in prompts]
eng.generate([GenerationRequest("warm", ids[0], 16)])
turn_s = float(os.environ.get("TURN_MS", 0)) / 1e3
for c in map(int, sys.argv[3:]):
    todo = [GenerationRequest(f"c{c}r{i}", x, 64, stop_token_ids=(tok.eos_token_id,)) for i, x in enumerate(ids)]
    rounds, n, t0 = [], 0, time.perf_counter()
    ready = [t0] * c  # closed loop: a client sends its next request TURN_MS after its last one finished
    owner: dict[str, int] = {}
    while todo or eng.has_unfinished:
        new = 0
        now = time.perf_counter()
        if not eng.has_unfinished and todo and min(ready) > now:
            time.sleep(min(ready) - now)
            now = time.perf_counter()
        for j in range(c):
            if todo and ready[j] is not None and ready[j] <= now:
                req = todo.pop(0)
                eng.add_request(req)
                owner[req.seq_id], ready[j] = j, None
                new += len(req.prompt_ids)
        rows = len(eng.seqs)
        t = time.perf_counter()
        outs = eng.step()
        end = time.perf_counter()
        rounds.append((end - t, rows, new))
        n += sum(len(o.new_tokens) for o in outs)
        for o in outs:
            if o.finished:
                ready[owner[o.seq_id]] = end + turn_s
    dt = time.perf_counter() - t0
    pr = [r for r in rounds if r[2]]
    dec = [r for r in rounds if not r[2]]
    print(json.dumps({"c": c, "tokens": n, "seconds": round(dt, 2), "tok_s": round(n / dt, 1), "rounds": len(rounds),
                      "prompt_rounds": len(pr), "prompt_round_s": round(sum(r[0] for r in pr), 2),
                      "decode_round_s": round(sum(r[0] for r in dec), 2),
                      "decode_ms_by_rows": {k: round(1e3 * sum(r[0] for r in dec if r[1] == k) /
                                                     max(1, sum(1 for r in dec if r[1] == k)), 1)
                                            for k in sorted({r[1] for r in dec})},
                      "prompt_detail": [(round(r[0], 3), r[1], r[2]) for r in pr],  # (s, rows, new prompt tokens)
                      "rounds_by_rows": {k: sum(1 for r in rounds if r[1] == k) for k in sorted({r[1] for r in rounds})},
                      # the budget's rounds by kind since the start (the warm-up included): [rounds, s, tokens, draft s]
                      "spent": {k: [round(x, 2) for x in v] for k, v in sorted(eng.budget.spent.items())}
                      if eng.budget is not None else None}),
          flush=True)
