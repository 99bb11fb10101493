"""Token trees and lookup candidates through the whole served stack (real Serve on 127.0.0.1, tiny float64 models):
the router builds the tree (lookup locally, the draft's spine and siblings remotely), the target deployment and a
DeepSpeed TP 2 group verify it with tree attention, and the output is still exactly the target's."""

from __future__ import annotations

import pytest

from conftest import deploy, tiny_config, undeploy
from serve_helpers import AUTH, Reference, post

pytestmark = pytest.mark.serve

TREE_SPEC = {"mode": "s2d", "policy": "fixed", "k": 3, "width": 3, "lookup": True, "lookup_alone": 3}
# Prompts that repeat themselves (as code and math do), so lookup finds candidates; and plain ones.
PROMPTS = ["def add(a, b): return a + b\ndef add(a, b):", "one two three one two three one two",
           "What is the capital of France?"]


@pytest.fixture(scope="module")
def tree_app(serve_instance, tiny_family):
    from s2d_ray.serve import build_app

    cfg = tiny_config(tiny_family, spec=TREE_SPEC)
    yield deploy(build_app(cfg), "trees", serve_instance, cfg)
    undeploy("trees")


def complete(app, model: str, prompt: str, max_tokens: int, **extra) -> dict:
    r = post(f"{app.url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0, **extra}, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("model,key", [("tiny-a", "a"), ("tiny-b", "b"), ("tiny-tp", "a")])
def test_served_tree_greedy_equals_target_greedy(tree_app, tiny_family, model, key):
    check_greedy(tree_app, tiny_family, model, key)


@pytest.fixture(scope="module")
def frontier_app(serve_instance, tiny_family):
    from s2d_ray.serve import build_app

    cfg = tiny_config(tiny_family, spec={**TREE_SPEC, "frontier": 3})
    yield deploy(build_app(cfg), "frontier", serve_instance, cfg)
    undeploy("frontier")


@pytest.mark.parametrize("model,key", [("tiny-a", "a"), ("tiny-tp", "a")])
def test_served_frontier_tree_greedy_equals_target_greedy(frontier_app, tiny_family, model, key):
    """The draft deployment expands the frontier (EAGLE-2 trees, its KV compacted between rounds); still exact."""
    check_greedy(frontier_app, tiny_family, model, key)


def check_greedy(app, tiny_family, model: str, key: str) -> None:
    dtype = "float32" if model == "tiny-tp" else "float64"
    ref = Reference(str(tiny_family[key]), dtype)
    nodes = accepted = lookup_accepted = 0
    for prompt in PROMPTS:
        body = complete(app, model, prompt, 32)
        assert body["choices"][0]["text"] == ref.text(ref.greedy(ref.ids(prompt), 32)), prompt
        m = body["metrics"]["speculative_decoding"]
        nodes += m["num_draft_tokens"]
        accepted += m["num_accepted_draft_tokens"]
        lookup_accepted += m["accepted_exit_histogram"].get("0", 0)
    assert 0 < accepted < nodes
    assert lookup_accepted > 0  # lookup branches were verified and accepted through the served path


def test_served_tree_sampling_equals_in_process(tree_app, tiny_family):
    """Seeded sampling over trees replays exactly: same tree, same coins, whatever process verifies it."""
    from s2d_ray.core.types import SamplingParams

    ref = Reference(str(tiny_family["a"]), "float64", draft=str(tiny_family["draft"]), spec=TREE_SPEC)
    prompt = PROMPTS[1]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=77)
    expected = ref.greedy(ref.ids(prompt), 24, params)
    body = complete(tree_app, "tiny-a", prompt, 24, temperature=0.8, top_p=0.9, seed=77)
    assert body["choices"][0]["text"] == ref.text(expected)
