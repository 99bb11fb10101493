"""LoRA targets on real Ray Serve: one tiny base serves adapters as model names of their own, one sorted draft for
all; each adapter's served greedy output equals that adapter merged into the base; adapters load and unload at run
time through vLLM's routes, and a bad adapter is refused with a 400 that changes nothing."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from conftest import deploy, undeploy
from helpers import make_tiny_llama, merge_lora, save_random_lora
from serve_helpers import Reference, post

pytestmark = pytest.mark.serve

PROMPTS = ["What is the capital of France?", "def add(a, b):"]


@pytest.fixture(scope="module")
def adapters(tiny_family, tmp_path_factory) -> dict:
    """Adapters x (in the config) and y (loaded at run time) of tiny-a, and each merged into tiny-a on disk."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("serve-lora")
    base = AutoModelForCausalLM.from_pretrained(tiny_family["a"], dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(tiny_family["a"])
    out = {"x": save_random_lora(base, root / "x", seed=1),
           "y": save_random_lora(base, root / "y", seed=2, r=2, modules=["q_proj", "v_proj", "up_proj"]),
           "wide": save_random_lora(base, root / "wide", seed=3, r=16),
           "other": save_random_lora(make_tiny_llama(vocab_size=320, hidden_size=48, dtype=torch.float64),
                                     root / "other", seed=4, r=2)}
    for name in ("x", "y"):
        merge_lora(base, out[name]).save_pretrained(root / f"merged-{name}")
        tok.save_pretrained(root / f"merged-{name}")
        out[f"merged-{name}"] = root / f"merged-{name}"
    return out


@pytest.fixture(scope="module")
def lora_app(serve_instance, tiny_family, adapters):
    from s2d_ray.serve import build_app

    cfg = {
        "targets": [{"name": "tiny-a", "source": str(tiny_family["a"]), "dtype": "float64", "num_cpus": 0.25,
                     "lora": {"adapters": {"tiny-a-x": str(adapters["x"])}, "max_loaded": 2, "max_rank": 8}}],
        "draft": {"source": str(tiny_family["draft"]), "dtype": "float64", "num_cpus": 0.25},
        "spec": {"mode": "s2d", "policy": "fixed", "k": 4},
        "router": {"num_cpus": 0.25},
        "api_key": "test-key-0123",
        "num_threads": 1,
    }
    yield deploy(build_app(cfg), "lora", serve_instance, cfg)
    undeploy("lora")


@pytest.fixture(scope="module")
def refs(tiny_family, adapters) -> dict[str, Reference]:
    return {"tiny-a": Reference(str(tiny_family["a"]), "float64"),
            "tiny-a-x": Reference(str(adapters["merged-x"]), "float64"),
            "tiny-a-y": Reference(str(adapters["merged-y"]), "float64")}


def complete(app, model: str, prompt: str, max_tokens: int = 20) -> dict:
    r = post(f"{app.url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def expected(ref: Reference, prompt: str, n: int = 20) -> str:
    return ref.text(ref.greedy(ref.ids(prompt), n))


def test_adapters_are_models_and_exact_per_adapter(lora_app, refs):
    models = {m["id"]: m for m in httpx_get(f"{lora_app.url}/v1/models")["data"]}
    assert models["tiny-a-x"]["parent"] == "tiny-a" and models["tiny-a"]["parent"] is None
    jobs = [(model, prompt) for prompt in PROMPTS for model in ("tiny-a", "tiny-a-x")]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:  # both models' rows in flight together
        bodies = list(pool.map(lambda job: complete(lora_app, *job), jobs))
    drafted = 0
    for (model, prompt), body in zip(jobs, bodies):
        assert body["model"] == model
        assert body["choices"][0]["text"] == expected(refs[model], prompt)
        drafted += body["metrics"]["speculative_decoding"]["num_draft_tokens"]
    assert drafted > 0  # the one draft speculated for the base and the adapter
    # Negative control: the adapter changes the output, so serving the base's rows for it would fail above.
    assert expected(refs["tiny-a"], PROMPTS[0]) != expected(refs["tiny-a-x"], PROMPTS[0])


def test_load_and_unload_at_run_time(lora_app, refs, adapters):
    url = lora_app.url
    assert post(f"{url}/v1/completions", {"model": "tiny-a-y", "prompt": "hi"}).status_code == 404
    r = post(f"{url}/v1/load_lora_adapter", {"lora_name": "tiny-a-y", "lora_path": str(adapters["y"])})
    assert r.status_code == 200, r.text
    assert complete(lora_app, "tiny-a-y", PROMPTS[0])["choices"][0]["text"] == expected(refs["tiny-a-y"], PROMPTS[0])
    r = post(f"{url}/v1/unload_lora_adapter", {"lora_name": "tiny-a-y"})
    assert r.status_code == 200, r.text
    assert post(f"{url}/v1/completions", {"model": "tiny-a-y", "prompt": "hi"}).status_code == 404
    assert post(f"{url}/v1/unload_lora_adapter", {"lora_name": "tiny-a-y"}).status_code == 404
    assert "tiny-a-y" not in {m["id"] for m in httpx_get(f"{url}/v1/models")["data"]}


@pytest.mark.parametrize("path_key, fragment", [("missing", "no adapter_config.json"), ("other", "another base"),
                                                ("wide", "rank 16 exceeds")])
def test_bad_adapter_is_a_400_and_disturbs_nothing(lora_app, refs, adapters, tmp_path, path_key, fragment):
    path = tmp_path / "nothing" if path_key == "missing" else adapters[path_key]
    r = post(f"{lora_app.url}/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(path)})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "lora_path"
    assert post(f"{lora_app.url}/v1/completions", {"model": "bad", "prompt": "hi"}).status_code == 404
    assert complete(lora_app, "tiny-a-x", PROMPTS[1])["choices"][0]["text"] == expected(refs["tiny-a-x"], PROMPTS[1])


def test_load_body_is_checked(lora_app, adapters):
    url = f"{lora_app.url}/v1/load_lora_adapter"
    taken = post(url, {"lora_name": "tiny-a", "lora_path": str(adapters["y"])})
    assert taken.status_code == 400 and "already served" in taken.json()["error"]["message"]
    assert post(url, {"lora_name": "z", "lora_path": str(adapters["y"]), "extra": 1}).status_code == 400
    assert post(url, {"lora_name": "z", "lora_path": str(adapters["y"]), "base_model": "nope"}).status_code == 400
    assert post(url, {"lora_name": "z"}).status_code == 400
    assert post(url, {"lora_name": "z", "lora_path": str(adapters["y"])}, headers={"authorization": ""}).status_code \
        == 401


def httpx_get(url: str) -> dict:
    import httpx

    from serve_helpers import AUTH

    r = httpx.get(url, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()
