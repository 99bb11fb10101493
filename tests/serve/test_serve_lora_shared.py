"""Runtime LoRA loads with two router replicas and target replicas started after a load, on real Ray Serve: a load
or unload through whichever router took it reaches every router (the adapter registry, serve/lora_registry.py), and
a target replica that starts after a load registers it before its first forward. Outputs are exact: each adapter's
served greedy text equals the adapter merged into the base and decoded plainly."""

from __future__ import annotations

import time

import httpx
import pytest
import torch
from conftest import deploy, undeploy
from helpers import merge_lora, save_random_lora
from serve_helpers import AUTH, HTTP_TIMEOUT, Reference, post, replica_actor, wait_until

pytestmark = pytest.mark.serve

APP = "lora-shared"
PROMPTS = ["What is the capital of France?", "def add(a, b):"]
REQUESTS = 12  # sequential requests: Serve's proxy spreads them over both routers (checked per router)


@pytest.fixture(scope="module")
def adapters(tiny_family, tmp_path_factory) -> dict:
    """Adapters y and z of tiny-a (neither in the config), y merged into tiny-a on disk."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("lora-shared")
    base = AutoModelForCausalLM.from_pretrained(tiny_family["a"], dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(tiny_family["a"])
    out = {"y": save_random_lora(base, root / "y", seed=2, r=2, modules=["q_proj", "v_proj", "up_proj"]),
           "z": save_random_lora(base, root / "z", seed=5, r=4)}
    merge_lora(base, out["y"]).save_pretrained(root / "merged-y")
    tok.save_pretrained(root / "merged-y")
    out["merged-y"] = root / "merged-y"
    return out


@pytest.fixture(scope="module")
def app(serve_instance, tiny_family):
    from s2d_ray.serve import build_app

    cfg = {
        "targets": [{"name": "tiny-a", "source": str(tiny_family["a"]), "dtype": "float64", "num_cpus": 0.25,
                     "lora": {"max_loaded": 2, "max_rank": 8}}],
        "draft": {"source": str(tiny_family["draft"]), "dtype": "float64", "num_cpus": 0.25},
        "spec": {"mode": "s2d", "policy": "fixed", "k": 4},
        "router": {"num_cpus": 0.25, "num_replicas": 2},
        "api_key": "test-key-0123",
        "num_threads": 1,
    }
    yield deploy(build_app(cfg), APP, serve_instance, cfg)
    undeploy(APP)


@pytest.fixture(scope="module")
def ref_y(adapters) -> Reference:
    return Reference(str(adapters["merged-y"]), "float64")


def completion(app, model: str, prompt: str) -> httpx.Response:
    return post(f"{app.url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 12,
                                              "temperature": 0})


def every_router(app) -> dict[str, dict]:
    """/stats of each of the 2 router replicas (Serve's proxy picks one per call: asked until both answered)."""
    seen: dict[str, dict] = {}

    def both():
        body = httpx.get(f"{app.url}/stats", headers=AUTH, timeout=HTTP_TIMEOUT).json()
        seen[body["router"]] = body
        return len(seen) == 2

    wait_until(both, timeout_s=60, interval_s=0.05)
    return seen


def served_per_router(model: str) -> dict[str, float]:
    """Requests of `model` finished by each router replica (the metrics hub's last push of each)."""
    from ray import serve

    hub = serve.get_deployment_handle("metrics", APP)
    counts = [hub.per_router.remote("vllm:request_success_total", {"model": model, "finished_reason": why}).result()
              for why in ("length", "stop")]
    return {r: sum(c.get(r, 0.0) for c in counts) for r in set().union(*counts)}


def finished_at_least(model: str, n: int) -> dict[str, float] | None:
    """served_per_router once the routers' pushes count `n` requests of `model` (None before)."""
    counts = served_per_router(model)
    return counts if sum(counts.values()) >= n else None


def test_load_through_one_router_is_served_by_every_router(app, adapters, ref_y):
    r = post(f"{app.url}/v1/load_lora_adapter", {"lora_name": "tiny-a-y", "lora_path": str(adapters["y"])})
    assert r.status_code == 200, r.text
    # Every router serves it at once (the one that did not take the load fetches the registry for the new name).
    for i in range(REQUESTS):
        prompt = PROMPTS[i % 2]
        body = completion(app, "tiny-a-y", prompt)
        assert body.status_code == 200, body.text
        assert body.json()["choices"][0]["text"] == ref_y.text(ref_y.greedy(ref_y.ids(prompt), 12))
    # Both routers served some (else the test would not show the second router learning of the load).
    per_router = wait_until(lambda: finished_at_least("tiny-a-y", REQUESTS), timeout_s=15)
    assert len([n for n in per_router.values() if n > 0]) == 2, per_router
    assert all("tiny-a-y" in s["adapters"] for s in every_router(app).values())
    # Negative control: an adapter registered on the target replica but not through the registry is served by no
    # router (the routers learn of adapters from the registry only).
    from ray import serve

    target = serve.get_deployment_handle("target-tiny-a", APP)
    assert "loaded" in target.load_adapter.remote("tiny-a-z", str(adapters["z"])).result()
    assert all(completion(app, "tiny-a-z", PROMPTS[0]).status_code == 404 for _ in range(6))
    assert all("tiny-a-z" not in s["adapters"] for s in every_router(app).values())


def test_unload_through_one_router_is_a_404_on_every_router(app, adapters, ref_y):
    if completion(app, "tiny-a-y", PROMPTS[0]).status_code == 404:  # run alone: load it first
        r = post(f"{app.url}/v1/load_lora_adapter", {"lora_name": "tiny-a-y", "lora_path": str(adapters["y"])})
        assert r.status_code == 200, r.text
    assert all("tiny-a-y" in s["adapters"] for s in every_router(app).values())
    r = post(f"{app.url}/v1/unload_lora_adapter", {"lora_name": "tiny-a-y"})
    assert r.status_code == 200, r.text
    # Once the unload returned, every router answers 404 for it, and lists it nowhere.
    assert all(completion(app, "tiny-a-y", PROMPTS[0]).status_code == 404 for _ in range(REQUESTS))
    assert all("tiny-a-y" not in s["adapters"] for s in every_router(app).values())
    for _ in range(4):
        models = httpx.get(f"{app.url}/v1/models", headers=AUTH, timeout=HTTP_TIMEOUT).json()["data"]
        assert "tiny-a-y" not in {m["id"] for m in models}
    assert post(f"{app.url}/v1/unload_lora_adapter", {"lora_name": "tiny-a-y"}).status_code == 404
    # The name is free again: a second load through either router is served exactly.
    r = post(f"{app.url}/v1/load_lora_adapter", {"lora_name": "tiny-a-y", "lora_path": str(adapters["y"])})
    assert r.status_code == 200, r.text
    body = completion(app, "tiny-a-y", PROMPTS[1])
    assert body.status_code == 200 and body.json()["choices"][0]["text"] == \
        ref_y.text(ref_y.greedy(ref_y.ids(PROMPTS[1]), 12))


def test_target_replica_started_after_a_load_serves_it(app, adapters, ref_y):
    import ray
    from ray import serve

    if completion(app, "tiny-a-y", PROMPTS[0]).status_code == 404:  # run alone: load it first
        r = post(f"{app.url}/v1/load_lora_adapter", {"lora_name": "tiny-a-y", "lora_path": str(adapters["y"])})
        assert r.status_code == 200, r.text
    target = serve.get_deployment_handle("target-tiny-a", APP)
    # tiny-a-z: registered on this replica directly, bypassing the registry (the negative control below)
    assert "loaded" in target.load_adapter.remote("tiny-a-z", str(adapters["z"])).result()
    old = target.stats.remote().result()
    assert {"tiny-a-y", "tiny-a-z"} <= set(old["lora"]["registered"])
    ray.kill(replica_actor(APP, "target-tiny-a"), no_restart=True)  # Serve starts a new replica in its place

    def restarted():
        try:
            stats = target.stats.remote().result(timeout_s=10)
        except Exception:  # the dead replica, or none yet
            return None
        return stats if stats["replica"] != old["replica"] else None

    wait_until(restarted, timeout_s=120, interval_s=1.0)
    for prompt in PROMPTS:  # its first forward registers the runtime loads first
        body = completion(app, "tiny-a-y", prompt)
        assert body.status_code == 200, body.text
        assert body.json()["choices"][0]["text"] == ref_y.text(ref_y.greedy(ref_y.ids(prompt), 12))
    new = target.stats.remote().result()
    assert new["replica"] != old["replica"]
    assert "tiny-a-y" in new["lora"]["registered"]
    # Negative control: what was registered on the old replica only (not through the registry) is gone.
    assert "tiny-a-z" not in new["lora"]["registered"]


LONG = 440  # tokens: requests still running when the unload arrives


def test_unload_lets_every_routers_running_requests_finish(app, adapters, ref_y):
    """An unload through one router waits for the adapter's requests admitted by every router: they all finish,
    exact, and only then do the target replicas forget it."""
    import concurrent.futures

    if completion(app, "tiny-a-y", PROMPTS[0]).status_code == 404:  # run alone: load it first
        r = post(f"{app.url}/v1/load_lora_adapter", {"lora_name": "tiny-a-y", "lora_path": str(adapters["y"])})
        assert r.status_code == 200, r.text
    prompts = [p for p in ["Once upon a time", "def add(a, b):", "What is the capital of France?", "1, 2, 3,"]
               if len(ref_y.greedy(ref_y.ids(p), LONG)) == LONG]  # no early EOS: they run the whole length
    assert prompts
    jobs = [prompts[i % len(prompts)] for i in range(6)]
    before = served_per_router("tiny-a-y")

    def run(prompt: str) -> httpx.Response:
        return post(f"{app.url}/v1/completions", {"model": "tiny-a-y", "prompt": prompt, "max_tokens": LONG,
                                                  "temperature": 0})

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        running = []
        for prompt in jobs:  # one at a time: Serve's proxy sends each to the router with fewer requests running
            running.append(pool.submit(run, prompt))
            time.sleep(0.2)
        # both routers run some when the unload arrives (else this shows only the unloading router's own wait)
        wait_until(lambda: all(s["targets"]["tiny-a"]["running"] for s in every_router(app).values()),
                   timeout_s=30, interval_s=0.02)
        unload = post(f"{app.url}/v1/unload_lora_adapter", {"lora_name": "tiny-a-y"})
        assert unload.status_code == 200, unload.text
        answers = [f.result() for f in running]
    for prompt, body in zip(jobs, answers):
        assert body.status_code == 200, body.text
        assert body.json()["choices"][0]["text"] == ref_y.text(ref_y.greedy(ref_y.ids(prompt), LONG))
    after = wait_until(lambda: finished_at_least("tiny-a-y", sum(before.values()) + len(jobs)), timeout_s=15)
    assert len([r for r in after if after[r] > before.get(r, 0.0)]) == 2, (before, after)
    assert completion(app, "tiny-a-y", PROMPTS[0]).status_code == 404
