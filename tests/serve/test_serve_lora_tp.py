"""LoRA adapters on a tensor-parallel target on real Ray Serve: a TP-2 target (two ranks cut by DeepSpeed AutoTP, its
checkpoint having no safetensors; the shard-read path is tests/unit/test_lora_tp.py's) serves an adapter from its
config and one loaded at run time, each rank holding its cut of them, each exact against that adapter merged into the
base and decoded on one process; a bad adapter is refused by every rank with a 400 that leaves the rest as it was."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from conftest import deploy, undeploy
from helpers import make_tiny_llama, merge_lora, save_random_lora
from serve_helpers import AUTH, Reference, post

pytestmark = pytest.mark.serve

PROMPTS = ["What is the capital of France?", "def add(a, b):"]


@pytest.fixture(scope="module")
def adapters(tiny_family, tmp_path_factory) -> dict:
    """Adapters x (in the config) and y (loaded at run time) of tiny-a, each also merged into tiny-a on disk, and
    tiny-a saved without safetensors (so the TP ranks load it whole and AutoTP cuts it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("serve-lora-tp")
    base = AutoModelForCausalLM.from_pretrained(tiny_family["a"], dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(tiny_family["a"])
    out = {"x": save_random_lora(base, root / "x", seed=1),
           "y": save_random_lora(base, root / "y", seed=2, r=2, modules=["q_proj", "o_proj", "down_proj"]),
           "other": save_random_lora(make_tiny_llama(vocab_size=320, hidden_size=48, dtype=torch.float64),
                                     root / "other", seed=4, r=2)}
    base.config.save_pretrained(root / "base-bin")  # save_pretrained writes safetensors only
    torch.save(base.state_dict(), root / "base-bin" / "pytorch_model.bin")
    tok.save_pretrained(root / "base-bin")
    out["base"] = root / "base-bin"
    for name in ("x", "y"):
        merge_lora(base, out[name]).save_pretrained(root / f"merged-{name}")
        tok.save_pretrained(root / f"merged-{name}")
        out[f"merged-{name}"] = root / f"merged-{name}"
    return out


@pytest.fixture(scope="module")
def lora_tp_app(serve_instance, tiny_family, adapters):
    from s2d_ray.serve import build_app

    cfg = {
        "targets": [{"name": "tiny-tp", "source": str(adapters["base"]), "dtype": "float32", "tp_size": 2,
                     "num_cpus": 0.1, "tp_worker_cpus": 0.25,
                     "lora": {"adapters": {"tiny-tp-x": str(adapters["x"])}, "max_loaded": 2, "max_rank": 8}}],
        "draft": {"source": str(tiny_family["draft"]), "dtype": "float64", "num_cpus": 0.25},
        "spec": {"mode": "s2d", "policy": "fixed", "k": 4},
        "router": {"num_cpus": 0.25},
        "api_key": "test-key-0123",
        "num_threads": 1,
    }
    yield deploy(build_app(cfg), "loratp", serve_instance, cfg)
    undeploy("loratp")  # one module uses it: its TP ranks must not outlive the module


@pytest.fixture(scope="module")
def refs(tiny_family, adapters) -> dict[str, Reference]:
    """Plain greedy decoding on one process, float32 as the TP target serves."""
    return {"tiny-tp": Reference(str(adapters["base"]), "float32"),
            "tiny-tp-x": Reference(str(adapters["merged-x"]), "float32"),
            "tiny-tp-y": Reference(str(adapters["merged-y"]), "float32")}


def complete(app, model: str, prompt: str, max_tokens: int = 20) -> dict:
    r = post(f"{app.url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def expected(ref: Reference, prompt: str, n: int = 20) -> str:
    return ref.text(ref.greedy(ref.ids(prompt), n))


def test_tp_adapter_rows_equal_the_merged_model_on_one_rank(lora_tp_app, refs):
    jobs = [(model, prompt) for prompt in PROMPTS for model in ("tiny-tp", "tiny-tp-x")]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:  # base and adapter rows in flight together
        bodies = list(pool.map(lambda job: complete(lora_tp_app, *job), jobs))
    for (model, prompt), body in zip(jobs, bodies):
        assert body["choices"][0]["text"] == expected(refs[model], prompt), model
    # Negative control: the adapter changes the output, so serving the base's rows for it would fail above.
    assert expected(refs["tiny-tp"], PROMPTS[0]) != expected(refs["tiny-tp-x"], PROMPTS[0])


def test_tp_load_reaches_every_rank_and_a_bad_adapter_is_refused(lora_tp_app, refs, adapters):
    import httpx

    url = lora_tp_app.url
    r = post(f"{url}/v1/load_lora_adapter", {"lora_name": "tiny-tp-y", "lora_path": str(adapters["y"])})
    assert r.status_code == 200, r.text
    # y adapts o/down (row-parallel) too: exact only if both ranks hold their cut of it
    assert complete(lora_tp_app, "tiny-tp-y", PROMPTS[0])["choices"][0]["text"] == \
        expected(refs["tiny-tp-y"], PROMPTS[0])
    bad = post(f"{url}/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(adapters["other"])})
    assert bad.status_code == 400 and "another base" in bad.json()["error"]["message"], bad.text
    assert post(f"{url}/v1/completions", {"model": "bad", "prompt": "hi"}).status_code == 404
    assert post(f"{url}/v1/unload_lora_adapter", {"lora_name": "tiny-tp-y"}).status_code == 200
    assert post(f"{url}/v1/completions", {"model": "tiny-tp-y", "prompt": "hi"}).status_code == 404
    stats = httpx.get(f"{url}/stats", headers=AUTH, timeout=30)
    assert stats.status_code == 200, stats.text
    held = [v for v in _values(stats.json(), "lora") if "registered" in v]  # rank 0's: all ranks run the same loads
    assert held and all(h["registered"] == ["tiny-tp-x"] for h in held), held
    assert set(_values(stats.json(), "loading")) == {"whole"}  # DeepSpeed AutoTP cut the ranks' layers
    assert complete(lora_tp_app, "tiny-tp-x", PROMPTS[1])["choices"][0]["text"] == \
        expected(refs["tiny-tp-x"], PROMPTS[1])


def _values(body, key: str):
    """Every value under `key` anywhere in a JSON body."""
    if isinstance(body, dict):
        for k, value in body.items():
            if k == key:
                yield value
            else:
                yield from _values(value, key)
    elif isinstance(body, list):
        for value in body:
            yield from _values(value, key)
