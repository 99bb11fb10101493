"""`draft.placement: router`: the router loads the shared draft and runs it on its own model thread. Served greedy
still equals in-process target-only greedy for two targets decoding at once, no draft deployment exists, and /health
reports the draft from the router's process."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from serve_helpers import HTTP_TIMEOUT, Reference, post

pytestmark = pytest.mark.serve

PROMPTS = ["What is the capital of France?", "def add(a, b):"]


@pytest.fixture(scope="module")
def placed_app(serve_instance, tiny_family):
    from conftest import deploy, tiny_config, undeploy
    from s2d_ray.serve import build_app

    cfg = tiny_config(tiny_family)
    cfg["targets"] = cfg["targets"][:2]  # tiny-a, tiny-b
    cfg["draft"] = {**{k: v for k, v in cfg["draft"].items() if k != "num_cpus"}, "placement": "router"}
    yield deploy(build_app(cfg), "placed", serve_instance, cfg)
    undeploy("placed")


def test_no_draft_deployment_and_greedy_equals_target_only(placed_app, tiny_family):
    from ray import serve

    deployments = serve.status().applications["placed"].deployments
    assert "draft" not in deployments and "router" in deployments
    refs = {"tiny-a": Reference(str(tiny_family["a"]), "float64"), "tiny-b": Reference(str(tiny_family["b"]), "float64")}
    jobs = [(model, prompt) for model in refs for prompt in PROMPTS]

    def complete(job):
        model, prompt = job
        r = post(f"{placed_app.url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 24,
                                                     "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:  # both targets' rounds at once
        bodies = list(pool.map(complete, jobs))
    drafted = 0
    for (model, prompt), body in zip(jobs, bodies):
        ref = refs[model]
        assert body["choices"][0]["text"] == ref.text(ref.greedy(ref.ids(prompt), 24)), (model, prompt)
        drafted += body["metrics"]["speculative_decoding"]["num_draft_tokens"]
    assert drafted > 0  # the draft in the router really proposed

    r = httpx.get(f"{placed_app.url}/health", timeout=HTTP_TIMEOUT)
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    draft = r.json()["draft"]
    assert draft["replica"] == r.json()["router"]  # the draft runs in the router's process
    assert draft["num_rows"] > 0 and draft["num_active"] == 0  # every finished sequence's draft KV was released
