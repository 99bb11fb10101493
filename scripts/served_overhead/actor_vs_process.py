"""Is a forward slower inside a Ray worker than in a plain process, with nothing else running? The same passes (the 24
serve-bench prompts' prefill one at a time, then 64 one-row greedy steps on each of 4 of them) timed in this process
and in a Ray actor on its model thread (serve/replica.ModelThread, like a target replica), alternating.
Usage: QUESTIONS=question.jsonl python scripts/served_overhead/actor_vs_process.py"""
import json, os, statistics, time
from pathlib import Path

import ray
import torch

from s2d_ray.bench.serve import mixed_prompts
from s2d_ray.build import build_engine
from s2d_ray.config import EngineConfig
from s2d_ray.core.types import ScoreRequest
from s2d_ray.prompts import encode_prompt


class Probe:
    def __init__(self) -> None:
        b = build_engine(EngineConfig.model_validate({"spec": {"mode": "ar"}, "num_threads": 1, "wide_threads": 2,
                                                      "target": {"dtype": "auto"}}))
        self.verifier = b.engine.verifier
        q = os.environ.get("QUESTIONS")
        self.ids = [encode_prompt(b.target.tokenizer, p, chat=False) for p in mixed_prompts(Path(q) if q else None)[:24]]

    def passes(self) -> dict:
        v, out = self.verifier, {}
        t = time.perf_counter()
        for i, x in enumerate(self.ids):
            v.score([ScoreRequest(f"p{i}", x, 1)])
        out["prefill_24_s"] = time.perf_counter() - t
        steps = []
        for i in range(4):
            toks = list(self.ids[i])
            for _ in range(64):
                s = time.perf_counter()
                nxt = int(v.score([ScoreRequest(f"p{i}", toks, 1)])[0][-1].argmax())
                steps.append(time.perf_counter() - s)
                toks.append(nxt)
        for i in range(len(self.ids)):
            v.release(f"p{i}")
        out["step_ms_median"] = 1e3 * statistics.median(steps)
        out["step_ms_mean"] = 1e3 * statistics.mean(steps)
        return out


@ray.remote(num_cpus=0.3)
class ProbeActor:
    def __init__(self) -> None:
        from s2d_ray.serve.replica import ModelThread

        self.thread, self.probe = ModelThread(1), None

    async def passes(self) -> dict:
        if self.probe is None:  # built on the model thread, as a replica loads its model
            self.probe = await self.thread.run(Probe)
        return await self.thread.run(self.probe.passes)


if __name__ == "__main__":
    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    actor = ProbeActor.remote()
    local = Probe()
    local.passes(), ray.get(actor.passes.remote())  # warm both
    for rep in range(3):
        print(json.dumps({"rep": rep, "process": local.passes(), "actor": ray.get(actor.passes.remote())}), flush=True)
