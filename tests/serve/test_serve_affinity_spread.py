"""Load balance with few routers (real Ray Serve, 127.0.0.1, tiny float64 models): ONE router, 2 draft and 2 target
replicas. Each sequence has its own affinity key, so the router's live sequences spread over both replicas of each
deployment (a round is one call per replica), while each sequence's rounds stay on the replica holding its KV: nothing
is recomputed and every output equals in-process greedy. With one key per router instead, all of the router's
rounds would go to one replica of each deployment and the other would idle (this test's first assertion)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from reliability_helpers import delete_app, deploy_app
from serve_helpers import API_KEY, AUTH, HTTP_TIMEOUT, wait_until

pytestmark = pytest.mark.serve

APP = "spread"
PROMPTS = ["What is the capital of France?", "def add(a, b):", "The quick brown fox", "Translate to German: good",
           "Once upon a time", "import numpy as np", "Dear Sir or Madam,", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def spread_app(serve_instance, tiny_family):
    from s2d_ray.serve import build_app

    two = {"num_replicas": 2, "num_cpus": 0.1}
    cfg = {
        "targets": [{"name": "tiny-a", "source": str(tiny_family["a"]), "dtype": "float64", "max_live_sequences": 32,
                     **two}],
        "draft": {"source": str(tiny_family["draft"]), "dtype": "float64", "max_live_sequences": 32, **two},
        "spec": {"mode": "s2d", "policy": "fixed", "k": 4},
        "limits": {"max_tokens_limit": 64, "max_concurrent_sequences": 8, "max_queued_requests": 64},
        "api_key": API_KEY,
        "router": {"num_replicas": 1, "num_cpus": 0.1},
        "num_threads": 1,
    }
    app = deploy_app(build_app(cfg), APP, serve_instance, cfg)
    yield app
    delete_app(APP)


def replica_stats(deployment: str) -> dict[str, dict]:
    """stats() of both replicas of a deployment (calls without a key go to either; poll until both answered)."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, APP)
    seen: dict[str, dict] = {}

    def both() -> bool:
        s = handle.stats.remote().result(timeout_s=30)
        seen[s["replica"]] = s
        return len(seen) == 2

    wait_until(both, timeout_s=30, interval_s=0.05)
    return seen


def test_one_routers_sequences_spread_over_replicas_and_stay_on_theirs(spread_app, tiny_family):
    from s2d_ray.bench.greedy_check import GreedyCheck, check_greedy
    from s2d_ray.bench.serve import LoadRun, run_load
    from s2d_ray.config import EngineConfig, TargetConfig

    run = LoadRun(spread_app.url, "tiny-a", [8], requests=32, max_tokens=24, temperature=0.0, api_key=API_KEY,
                  return_token_ids=True)
    result = asyncio.run(run_load(run, PROMPTS))
    assert result["summary"][0]["completed"] == 32, result["summary"]

    stats = {d: replica_stats(d) for d in ("draft", "target-tiny-a")}
    for deployment, per_replica in stats.items():
        calls = {r: s["num_calls"] for r, s in per_replica.items()}
        # Both replicas served this one router's rounds, neither a token share below a quarter of the calls.
        assert min(calls.values()) >= 0.25 * sum(calls.values()), (deployment, calls)
    # A round is one call per replica, not one per sequence: the router learned the replica set from its request
    # router (the calls of the first round, before it had, go one per sequence).
    draft = stats["draft"].values()
    assert sum(s["num_rows"] for s in draft) >= 2 * sum(s["num_calls"] for s in draft), list(draft)

    health = httpx.get(f"{spread_app.url}/stats", headers=AUTH, timeout=HTTP_TIMEOUT).json()
    recomputed = {d: sum(per.values()) for d, per in health["recomputed_tokens"].items()}
    assert recomputed.get("draft", 0) == 0 and recomputed.get("target-tiny-a", 0) == 0, recomputed

    engine = EngineConfig(target=TargetConfig(name="tiny-a", source=str(tiny_family["a"]), dtype="float64"),
                          num_threads=1)
    check = check_greedy(result, PROMPTS, GreedyCheck(engine))
    assert (check["equal"], check["passed"]) == (32, True), check["differences"]
