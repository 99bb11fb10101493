"""/metrics with 2 router replicas: Serve's load balancer sends each scrape to either router, and each answers with
the whole app's counters (the metrics hub), so no counter ever goes down from one scrape to the next and the totals
count every request exactly once, whichever router served it."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve_helpers import AUTH, HTTP_TIMEOUT, post, wait_until

pytestmark = pytest.mark.serve

APP = "metrics2"
REQUESTS = 24
DONE = 'vllm:request_success_total{finished_reason="length",model="tiny-a"}'
TOKENS = 'vllm:generation_tokens_total{model="tiny-a"}'
HITS = 'vllm:prefix_cache_hits_total{model="tiny-a"}'


@pytest.fixture(scope="module")
def two_routers(serve_instance, tiny_family):
    from conftest import deploy, tiny_config, undeploy
    from s2d_ray.serve import build_app

    cfg = tiny_config(tiny_family)
    cfg["targets"] = cfg["targets"][:1]
    cfg["spec"] = {"mode": "lookup"}
    cfg["router"] = {"num_cpus": 0.25, "num_replicas": 2}
    yield deploy(build_app(cfg), APP, serve_instance, cfg)
    undeploy(APP)


def scrape(app) -> dict[str, float]:
    r = httpx.get(f"{app.url}/metrics", headers=AUTH, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    out = {}
    for line in r.text.splitlines():
        m = re.match(r"^(\S+\{[^}]*\}|\S+) (\S+)$", line)
        if m and not line.startswith("#"):
            out[_canonical(m.group(1))] = float(m.group(2))
    return out


def _canonical(series: str) -> str:
    """Labels sorted, so a series reads the same whatever order the exposition gives them."""
    name, _, labels = series.partition("{")
    if not labels:
        return name
    pairs = sorted(re.findall(r'(\w+)="([^"]*)"', labels))
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in pairs) + "}"


def test_counters_never_decrease_and_count_every_request_once(two_routers):
    from ray import serve

    prompt = " ".join(f"counted request words {i}" for i in range(12))  # long enough to be kept by the prefix cache

    def one(i: int) -> None:
        r = post(f"{two_routers.url}/v1/completions", {"model": "tiny-a", "prompt": prompt, "max_tokens": 6,
                                                        "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text

    seen: list[dict[str, float]] = [scrape(two_routers)]
    with ThreadPoolExecutor(8) as pool:
        for batch in range(3):
            list(pool.map(one, range(REQUESTS // 3)))
            seen += [scrape(two_routers) for _ in range(4)]  # each lands on either router
    final = wait_until(lambda: (lambda m: m if m.get(DONE) == REQUESTS else None)(scrape(two_routers)), timeout_s=15)
    seen.append(final)
    counters = [k for k in final if k.endswith("_total") or "_bucket{" in k or k.endswith("_count")
                or "_count{" in k or "_sum{" in k]
    for before, after in zip(seen, seen[1:]):
        for key in counters:
            assert after.get(key, 0.0) >= before.get(key, 0.0), (key, before.get(key), after.get(key))
    assert final[TOKENS] == 6 * REQUESTS
    stats = httpx.get(f"{two_routers.url}/stats", headers=AUTH, timeout=HTTP_TIMEOUT).json()
    hits = stats["targets"]["tiny-a"]["prefix_cache"]["prefix_cache_hits"]
    assert hits > 0 and scrape(two_routers)[HITS] == hits  # the target's count, once, however many routers scrape
    hub = serve.get_deployment_handle("metrics", APP)
    per_router = hub.per_router.remote("vllm:request_success_total",
                                       {"model": "tiny-a", "finished_reason": "length"}).result()
    assert len([n for n in per_router.values() if n > 0]) == 2, per_router  # both routers served (else trivial)
    assert sum(per_router.values()) == REQUESTS
