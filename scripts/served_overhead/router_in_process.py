"""The router's whole request path (the Router class: schedulers, engine, the draft and every tp_size-1 target placed
in it) in ONE plain process: no Ray, no Serve, no HTTP. Sequential concurrency-1 generations of the serve bench's 24
prompts, 64 tokens greedy; prints tok/s and ms per kind of round. Against `inproc_load.py` (the engine alone) it tells
what the router's code costs; against served figures, what Ray, Serve and HTTP cost.
TWO_THREADS=1 gives the draft and each target a model thread of their own (the layout before session 26).
REPEAT=k decodes the prompts k times (one line each; the first pass is the cold one). IN_RAY=1 runs the same inside
a Ray actor (a local Ray; no Serve, no HTTP): what a Ray worker process costs the router's forwards (session 27). WHOLE=0 sets `router.whole_rounds: false` (every round
through the batch queues, the path before session 28).
Usage: python scripts/served_overhead/router_in_process.py YAML [s2d|ar] [N]"""
import asyncio, json, os, sys, time

import ray.serve.batching as batching
import yaml

from s2d_ray.bench.serve import mixed_prompts
from s2d_ray.serve import AppConfig
from s2d_ray.serve.openai_protocol import GenerateRequest


args = yaml.safe_load(open(sys.argv[1]))["applications"][0]["args"]
mode = sys.argv[2] if len(sys.argv) > 2 else "s2d"
n = int(sys.argv[3]) if len(sys.argv) > 3 else 24
targets = []
for t in args["targets"]:
    if t.get("tp_size", 1) == 1:
        t.pop("num_cpus", None)
        targets.append({**t, "placement": "router"})
args["targets"] = targets
if os.environ.get("WHOLE") == "0":
    args["router"] = {**args.get("router", {}), "whole_rounds": False}
cfg = AppConfig.model_validate(args)
if os.environ.get("TWO_THREADS"):
    import s2d_ray.serve.draft_deployment as dd
    import s2d_ray.serve.target_deployment as td
    from s2d_ray.serve.replica import ModelThread

    dd.process_model_thread = td.process_model_thread = ModelThread  # a new thread per model
from s2d_ray.serve.router import Router

prompts = mixed_prompts(None)[:n]
repeat = int(os.environ.get("REPEAT", 1))


def build():
    # @serve.batch asks for the replica context only to warn about max_ongoing_requests: there is none here.
    batching._BatchQueue._warn_if_max_batch_size_exceeds_max_ongoing_requests = lambda self: None
    cls = Router.func_or_class  # Serve's ingress wrapper; its base is our class
    router = cls.__new__(cls)
    cls.__mro__[1].__init__(router, cfg, None, {})
    return router


async def passes(router) -> list[dict]:
    model, out = "smollm2-135m-instruct", []
    await router.generate(GenerateRequest(model=model, prompt=prompts[0], max_tokens=16, temperature=0))
    for k in range(repeat):
        before = {a: dict(b) for a, b in (router.schedulers[model].timing().get("speculation", {}).get("spent")
                                          or {}).items()}
        toks, t0 = 0, time.perf_counter()
        for p in prompts:
            r = await router.generate(GenerateRequest(model=model, prompt=p, max_tokens=64, temperature=0,
                                                      speculate=(mode == "s2d")))
            toks += r.usage.completion_tokens
        dt = time.perf_counter() - t0
        spent = router.schedulers[model].timing().get("speculation", {}).get("spent") or {}
        rounds = {a: (v["rounds"] - before.get(a, {}).get("rounds", 0), v["seconds"] - before.get(a, {}).get("seconds", 0))
                  for a, v in spent.items()}
        out.append({"mode": mode, "pass": k, "in_ray": bool(os.environ.get("IN_RAY")), "whole": cfg.router.whole_rounds,
                    "whole_rounds": router.schedulers[model].rounds_now,
                    "two_threads": bool(os.environ.get("TWO_THREADS")), "tokens": toks, "seconds": round(dt, 2),
                    "tok_s": round(toks / dt, 2),
                    "ms_per_round": {a: [r, round(1e3 * s / max(r, 1), 1)] for a, (r, s) in rounds.items() if r}})
    return out


if os.environ.get("IN_RAY"):
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")

    @ray.remote(num_cpus=0)
    class InRay:
        def run(self) -> list[dict]:
            return asyncio.run(passes(build()))

    results = ray.get(InRay.remote().run.remote())
    ray.shutdown()
else:
    results = asyncio.run(passes(build()))
for r in results:
    print(json.dumps(r), flush=True)
