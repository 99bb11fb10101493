"""What a target call costs beyond the model, part by part: a bare Serve handle call, the same through @serve.batch
(as TargetDeployment.score, no wait), and batch + the hop to a one-thread model executor (serve/replica.ModelThread)
doing nothing. Payload like a plain round: 8 token lists of 1000 ids. Run on a quiet machine."""
import statistics, time, ray
from ray import serve
from s2d_ray.serve.replica import ModelThread


@serve.deployment(ray_actor_options={"num_cpus": 0.3})
class Bare:
    async def f(self, x, seen, affinity=None):
        return x[:1]


@serve.deployment(ray_actor_options={"num_cpus": 0.3})
class Batched:
    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.0)
    async def f(self, xs, seens, affinity):
        return [x[:1] for x in xs]


@serve.deployment(ray_actor_options={"num_cpus": 0.3})
class BatchedHop:
    def __init__(self):
        self.thread = ModelThread(1)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.0)
    async def f(self, xs, seens, affinity):
        await self.thread.run(lambda: None)
        return [x[:1] for x in xs]


@serve.deployment(ray_actor_options={"num_cpus": 0.3})
class Caller:
    def __init__(self, bare, batched, hop):
        self.targets = {"bare": bare, "batch": batched, "batch+hop": hop}

    async def run(self, n):
        x = [list(range(1000)) for _ in range(8)]
        out = {}
        for name, h in self.targets.items():
            lat = []
            for _ in range(n):
                t = time.perf_counter()
                await h.f.remote(x, [0] * 8, affinity=None)
                lat.append(time.perf_counter() - t)
            lat = lat[n // 5:]
            out[name] = "mean %.2f ms p50 %.2f p90 %.2f" % (1e3 * statistics.mean(lat), 1e3 * statistics.median(lat),
                                                           1e3 * sorted(lat)[int(.9 * len(lat))])
        return out


ray.init(num_cpus=2, include_dashboard=False)
h = serve.run(Caller.bind(Bare.bind(), Batched.bind(), BatchedHop.bind()), name="parts", route_prefix=None)
for rep in range(2):
    for k, v in h.run.remote(300).result().items():
        print(rep, k, v, flush=True)
serve.shutdown(); ray.shutdown()
