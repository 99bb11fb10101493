"""Admission from memory, served: a target sized by `memory_fraction` to hold 2 KV rows makes the router run at most 2
of its sequences at once; the others queue (no error, no eviction) and every answer is still plain greedy's. /stats
names the device and dtype of the router and of the target replica."""

from __future__ import annotations

import time

import httpx
import pytest

from conftest import deploy, undeploy
from serve_helpers import AUTH, HTTP_TIMEOUT, Reference
from s2d_ray.core.engine import GenerationRequest
from s2d_ray.models.capacity import GIB, ModelShape, read_model_config

pytestmark = pytest.mark.serve

ROWS, REQUESTS, MAX_TOKENS = 2, 4, 160
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "Speculative decoding drafts"]


def admission_config(source: str, memory_fraction: float | None) -> dict:
    """A target-only app whose budget (device_memory_gib x memory_fraction) holds the weights and ROWS.5 rows."""
    config = read_model_config(source)
    shape, slots = ModelShape.from_config(config), min(512, int(config["max_position_embeddings"]))
    need = shape.weight_bytes("float64") + (ROWS + 0.5) * slots * shape.kv_bytes_per_token("float64")
    sizing = {"memory_fraction": memory_fraction} if memory_fraction else {}
    return {
        "targets": [{"name": "tiny-a", "source": source, "dtype": "float64", "num_cpus": 0.25,
                     "device_memory_gib": need / GIB, **sizing}],
        "spec": {"mode": "ar"},
        "limits": {"max_total_tokens": 512, "max_tokens_limit": MAX_TOKENS, "max_concurrent_sequences": REQUESTS,
                   "max_queued_requests": REQUESTS},
        "router": {"num_cpus": 0.25},
        "num_threads": 1,
    }


def test_the_budget_sets_the_routers_admission(tiny_family):
    """Negative control of the served test: without memory_fraction the router would run all 4 at once."""
    from s2d_ray.serve import AppConfig

    source = str(tiny_family["a"])
    assert AppConfig.model_validate(admission_config(source, 1.0)).max_sequences("tiny-a") == ROWS
    assert AppConfig.model_validate(admission_config(source, None)).max_sequences("tiny-a") == REQUESTS


@pytest.fixture(scope="module")
def admission_app(serve_instance, tiny_family):
    from s2d_ray.serve import build_app

    cfg = admission_config(str(tiny_family["a"]), 1.0)
    yield deploy(build_app(cfg), "admission", serve_instance, cfg)
    undeploy("admission")


def greedy_no_stop(ref: Reference, prompt: str) -> list[int]:
    """Plain greedy for MAX_TOKENS tokens, EOS not stopping it (the requests send ignore_eos)."""
    req = GenerationRequest(f"ref-{prompt}", ref.ids(prompt), MAX_TOKENS)
    return ref.built.engine.generate([req])[0].token_ids


def test_sequences_beyond_the_rows_queue_and_still_decode_exactly(admission_app, tiny_family):
    from s2d_ray.serve.openai_protocol import GenerateRequest

    handle = admission_app.handle
    calls = [handle.generate.remote(GenerateRequest(model="tiny-a", prompt=p, max_tokens=MAX_TOKENS, ignore_eos=True))
             for p in PROMPTS]
    running, waiting = [], []
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        target = handle.stats.remote().result()["targets"]["tiny-a"]
        running.append(target["running"])
        waiting.append(target["waiting"])
        if max(running) > 0 and target["running"] == 0 and target["waiting"] == 0:
            break  # all four admitted and finished
    answers = [c.result() for c in calls]
    assert max(running) == ROWS and max(waiting) >= 1, (running, waiting)  # queued, never more than the rows
    ref = Reference(str(tiny_family["a"]), "float64")
    for prompt, answer in zip(PROMPTS, answers):
        assert answer.token_ids == greedy_no_stop(ref, prompt), prompt
    deployment = handle.stats.remote().result()["targets"]["tiny-a"]["deployment"]
    assert deployment["num_evicted"] == 0  # the router never asked the replica for a third row


def test_health_names_each_processs_device_and_dtype(admission_app):
    health = httpx.get(f"{admission_app.url}/stats", headers=AUTH, timeout=HTTP_TIMEOUT).json()
    assert (health["device"], health["dtype"]) == ("cpu", None)  # the router samples on the CPU, holds no model
    deployment = health["targets"]["tiny-a"]["deployment"]
    assert (deployment["device"], deployment["dtype"]) == ("cpu", "float64")
