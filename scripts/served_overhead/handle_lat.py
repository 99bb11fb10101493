"""Round-trip latency of a Ray Serve handle call between two deployments on this machine (payload like a round)."""
import asyncio, time, statistics, ray
from ray import serve

@serve.deployment(ray_actor_options={"num_cpus": 0.5})
class Echo:
    async def f(self, x, seen, affinity=None):
        return x

@serve.deployment(ray_actor_options={"num_cpus": 0.5})
class Caller:
    def __init__(self, echo):
        self.echo = echo
    async def run(self, n, size):
        x = [list(range(size))]
        lat = []
        for _ in range(n):
            t = time.perf_counter(); await self.echo.f.remote(x, [0]); lat.append(time.perf_counter() - t)
        return lat

ray.init(num_cpus=2, include_dashboard=False)
h = serve.run(Caller.bind(Echo.bind()), name="lat", route_prefix=None)
for size in (10, 1000):
    lat = h.run.remote(300, size).result()[50:]
    print(size, "mean %.2f ms p50 %.2f p90 %.2f" % (1e3 * statistics.mean(lat), 1e3 * statistics.median(lat), 1e3 * sorted(lat)[int(.9 * len(lat))]))
serve.shutdown(); ray.shutdown()
