"""Adapter affinity on real Ray Serve (127.0.0.1, tiny float64 models): ONE router, a LoRA target of 2 replicas that
each keep one adapter resident. After adapter x was loaded on one replica, x's later requests go there and the other
replica never binds x; with `router.prefix_routing.adapter_affinity` off (the negative control) the same requests
spread and both replicas bind x. Either way a replica that did not hold x serves it exactly (the holder over the load
bound, or no preference), each output equal to x merged into the base."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from conftest import deploy, undeploy
from helpers import merge_lora, save_random_lora
from serve_helpers import Reference, post, wait_until

pytestmark = pytest.mark.serve

PROMPTS = ["What is the capital of France?", "def add(a, b):", "The quick brown fox", "Translate to German: good",
           "Once upon a time", "import numpy as np", "Dear Sir or Madam,", "1, 2, 3, 4,", "Roses are red",
           "SELECT * FROM"]


@pytest.fixture(scope="module")
def adapter_x(tiny_family, tmp_path_factory) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("lora-routing")
    base = AutoModelForCausalLM.from_pretrained(tiny_family["a"], dtype=torch.float64).eval()
    x = save_random_lora(base, root / "x", seed=1)
    merge_lora(base, x).save_pretrained(root / "merged-x")
    AutoTokenizer.from_pretrained(tiny_family["a"]).save_pretrained(root / "merged-x")
    return {"x": x, "ref": Reference(str(root / "merged-x"), "float64")}


def lora_app(serve_instance, tiny_family, adapter_x, name: str, affinity: bool):
    from s2d_ray.serve import build_app

    cfg = {
        "targets": [{"name": "tiny-a", "source": str(tiny_family["a"]), "dtype": "float64", "num_replicas": 2,
                     "num_cpus": 0.1, "lora": {"adapters": {"tiny-a-x": str(adapter_x["x"])}, "max_loaded": 1,
                                               "max_rank": 8}}],
        "draft": {"source": str(tiny_family["draft"]), "dtype": "float64", "num_cpus": 0.1},
        "spec": {"mode": "s2d", "policy": "fixed", "k": 4},
        "limits": {"max_tokens_limit": 64, "max_concurrent_sequences": 16, "max_queued_requests": 64},
        # max_imbalance 1: two live x sequences of this router already overflow the holder (the fallback below).
        "router": {"num_replicas": 1, "num_cpus": 0.1,
                   "prefix_routing": {"adapter_affinity": affinity, "max_imbalance": 1}},
        "api_key": "test-key-0123",
        "num_threads": 1,
    }
    return deploy(build_app(cfg), name, serve_instance, cfg)


def complete(app, model: str, prompt: str, max_tokens: int = 16) -> str:
    r = post(f"{app.url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def resident(app_name: str) -> dict[str, list[str]]:
    """Each target replica's resident adapters (stats calls without a key go to either; poll until both answered)."""
    from ray import serve

    handle = serve.get_deployment_handle("target-tiny-a", app_name)
    seen: dict[str, list[str]] = {}

    def both() -> bool:
        s = handle.stats.remote().result(timeout_s=30)
        seen[s["replica"]] = s["lora"]["resident"]
        return len(seen) == 2

    wait_until(both, timeout_s=60, interval_s=0.05)
    return seen


def run_x_one_at_a_time(app, ref: Reference) -> None:
    complete(app, "tiny-a", "warm up")  # the router learns the target's replicas from this request's calls
    for prompt in PROMPTS:
        assert complete(app, "tiny-a-x", prompt) == ref.text(ref.greedy(ref.ids(prompt), 16))


@pytest.mark.parametrize("affinity", [True, False], ids=["preferred", "off"])
def test_an_adapters_requests_go_to_the_replica_holding_it(serve_instance, tiny_family, adapter_x, affinity):
    name = f"lora-route-{'on' if affinity else 'off'}"
    app = lora_app(serve_instance, tiny_family, adapter_x, name, affinity)
    try:
        ref = adapter_x["ref"]
        run_x_one_at_a_time(app, ref)
        held = resident(name)
        holders = sorted(r for r, names in held.items() if "tiny-a-x" in names)
        if affinity:
            assert len(holders) == 1, held  # every x request after the first went to the replica holding x
            assert [names for r, names in held.items() if r not in holders] == [[]], held
            # Over the load bound the holder is skipped: the other replica loads x and answers exactly.
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                texts = list(pool.map(lambda p: complete(app, "tiny-a-x", p, 48), PROMPTS[:6]))
            assert texts == [ref.text(ref.greedy(ref.ids(p), 48)) for p in PROMPTS[:6]]
            assert all("tiny-a-x" in names for names in resident(name).values()), resident(name)
        else:
            assert len(holders) == 2, held  # negative control: without the preference x's requests spread
    finally:
        undeploy(name)
