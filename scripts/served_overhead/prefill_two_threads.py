"""One process, one model: the serve bench's 24 prompts' prefill (one 1-logit ScoreRequest each, wide passes on 2
threads) on the main thread and/or on a serve ModelThread, in the order given. Once BOTH threads have run parallel
regions, libgomp keeps a worker pool per thread, the workers outnumber the 2 cores, their spin-wait is throttled and
every prefill slows (session 26: 2.7-3.0 s on one thread, 5.2-5.7 s on either once both ran).
Usage: python scripts/served_overhead/prefill_two_threads.py main,thread,main,thread"""
import asyncio, sys, time

import torch

from s2d_ray.bench.serve import mixed_prompts
from s2d_ray.build import build_engine
from s2d_ray.config import EngineConfig
from s2d_ray.core.types import ScoreRequest
from s2d_ray.prompts import encode_prompt
from s2d_ray.serve.replica import ModelThread

torch.set_num_threads(1)
b = build_engine(EngineConfig.model_validate({"spec": {"mode": "ar"}, "num_threads": 1, "wide_threads": 2}))
verifier, tok = b.engine.verifier, b.target.tokenizer
ids = [encode_prompt(tok, p, chat=False) for p in mixed_prompts(None)[:24]]
thread = ModelThread(1)


def prefill(i: int, x: list[int]) -> float:
    start = time.perf_counter()
    verifier.score([ScoreRequest(f"s{i}", x, 1)])
    verifier.release(f"s{i}")
    return time.perf_counter() - start


async def main() -> None:
    out = []
    for where in sys.argv[1].split(","):
        if where == "main":
            out.append(("main", sum(prefill(i, x) for i, x in enumerate(ids))))
        else:
            out.append(("thread", sum([await thread.run(prefill, i, x) for i, x in enumerate(ids)])))
    print(sys.argv[1], [(w, round(t, 2)) for w, t in out], flush=True)


asyncio.run(main())
