"""`draft.placement: router` and a target's `placement: router`: the router loads the shared draft and one target
and runs both on its one model thread. Served greedy still equals in-process target-only greedy for two targets
decoding at once (one in the router, one a deployment), neither the draft nor the placed target has a deployment, and
/stats reports both from the router's process, their KV released."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from serve_helpers import AUTH, HTTP_TIMEOUT, Reference, post

pytestmark = pytest.mark.serve

PROMPTS = ["What is the capital of France?", "def add(a, b):"]


@pytest.fixture(scope="module")
def placed_app(serve_instance, tiny_family):
    from conftest import deploy, tiny_config, undeploy
    from s2d_ray.serve import build_app

    cfg = tiny_config(tiny_family)
    placed_b = {k: v for k, v in cfg["targets"][1].items() if k != "num_cpus"}
    cfg["targets"] = [cfg["targets"][0], {**placed_b, "placement": "router"}]  # tiny-a a deployment, tiny-b in the router
    cfg["draft"] = {**{k: v for k, v in cfg["draft"].items() if k != "num_cpus"}, "placement": "router"}
    yield deploy(build_app(cfg), "placed", serve_instance, cfg)
    undeploy("placed")


def test_no_draft_deployment_and_greedy_equals_target_only(placed_app, tiny_family):
    from ray import serve

    deployments = serve.status().applications["placed"].deployments
    assert "draft" not in deployments and "target-tiny-b" not in deployments
    assert {"router", "target-tiny-a"} <= set(deployments)
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

    r = httpx.get(f"{placed_app.url}/stats", headers=AUTH, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    draft = r.json()["draft"]
    assert draft["replica"] == r.json()["router"]  # the draft runs in the router's process
    assert draft["num_rows"] > 0 and draft["num_active"] == 0  # every finished sequence's draft KV was released
    placed = r.json()["targets"]["tiny-b"]["deployment"]
    assert placed["replica"] == r.json()["router"]  # the target runs in the router's process too
    assert placed["num_calls"] > 0 and placed["num_active"] == 0  # it verified, and every finished sequence's KV left
    assert r.json()["targets"]["tiny-a"]["deployment"]["replica"] != r.json()["router"]


def test_a_placed_target_alone_runs_whole_rounds_on_the_model_thread(placed_app, tiny_family):
    """tiny-b (placed, with the draft placed) decoding while tiny-a has no work: its rounds run whole on the model
    thread (`router.whole_rounds`, the default), the output still target-only greedy, the draft still proposing, and
    every sequence's KV (draft and target) released on that thread."""

    def whole() -> int:
        r = httpx.get(f"{placed_app.url}/stats", headers=AUTH, timeout=HTTP_TIMEOUT)
        assert r.status_code == 200, r.text
        rounds = r.json()["targets"]["tiny-b"]["timing"]["round"]
        return rounds["whole"], rounds["rounds"], r.json()

    before, rounds_before, _ = whole()
    ref = Reference(str(tiny_family["b"]), "float64")
    drafted = 0
    for prompt in PROMPTS:
        r = post(f"{placed_app.url}/v1/completions", {"model": "tiny-b", "prompt": prompt, "max_tokens": 24,
                                                     "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref.text(ref.greedy(ref.ids(prompt), 24)), prompt
        drafted += r.json()["metrics"]["speculative_decoding"]["num_draft_tokens"]
    after, rounds_after, health = whole()
    assert drafted > 0 and after - before == rounds_after - rounds_before > 0  # every round of both requests
    assert health["draft"]["num_active"] == 0 and health["targets"]["tiny-b"]["deployment"]["num_active"] == 0


def test_a_placed_target_takes_no_deployment_options():
    from s2d_ray.serve import AppConfig

    for bad, words in (({"num_cpus": 0.5}, "num_cpus would not apply"), ({"tp_size": 2}, "tensor-parallel")):
        with pytest.raises(ValueError, match=words):
            AppConfig.model_validate({"targets": [{"name": "t", "placement": "router", **bad}]})
