"""What a second intra-op thread buys a verify pass, by its width: 1 row x n tree nodes and n rows x 1 position over
the bench prompts' contexts, bf16, 1 vs 2 threads (median of 15 passes each). Picks core/threads.WIDE_PASS_POSITIONS.
Usage: QUESTIONS=question.jsonl python scripts/served_overhead/wide_passes.py"""
import os, statistics, time, torch
from pathlib import Path
from s2d_ray.config import EngineConfig
from s2d_ray.build import build_engine
from s2d_ray.bench.serve import mixed_prompts
from s2d_ray.core.types import ScoreRequest
from s2d_ray.prompts import encode_prompt

b = build_engine(EngineConfig.model_validate({"spec": {"mode": "ar"}, "num_threads": 1, "target": {"dtype": "auto"}}))
ver = b.engine.verifier
ids = [encode_prompt(b.target.tokenizer, p, chat=False)[:300] for p in mixed_prompts(Path(os.environ["QUESTIONS"]))[:16]]
for i, x in enumerate(ids):  # fill every row's prefix once
    ver.score([ScoreRequest(f"r{i}", x, 1)])


def timed(reqs, threads):
    torch.set_num_threads(threads)
    out = []
    for _ in range(15):
        t = time.perf_counter()
        ver.score(reqs)
        out.append(time.perf_counter() - t)
    torch.set_num_threads(1)
    return 1e3 * statistics.median(out)


for n in (1, 4, 8, 12, 16, 24, 32):
    tree = [ScoreRequest("r0", ids[0] + list(range(100, 100 + n)), n + 1, parents=[-1] + list(range(n - 1)))]
    rows = [ScoreRequest(f"r{i}", ids[i] + [100], 1) for i in range(min(n, 16))]
    print("n=%2d  tree 1 row: %.1f / %.1f ms   %d rows x 1: %.1f / %.1f ms  (1 / 2 threads)"
          % (n, timed(tree, 1), timed(tree, 2), len(rows), timed(rows, 1), timed(rows, 2)), flush=True)
