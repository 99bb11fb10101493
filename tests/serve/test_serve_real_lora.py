"""deployments/local.yaml's LoRA adapters served on Ray over the real SmolLM2-135M-Instruct (fp32) with the committed
sorted draft: the base and every adapter requested together (their rows share verification forwards and the one
draft), each answer equal to its adapter merged into the base (peft) and decoded plainly, except at fp32 near-ties
(the unmerged sum rounds differently from merged weights), detected by the merged model's top-2 logit gap. Negative
control: the merged models' outputs differ pairwise, so a row verified under the wrong adapter would fail."""

from __future__ import annotations

import concurrent.futures
import copy
from pathlib import Path

import pytest
import torch
import yaml

from conftest import deploy, real_draft_source, undeploy
from serve_helpers import post

pytestmark = [pytest.mark.serve, pytest.mark.real]

BASE = "smollm2-135m-instruct"
PROMPT = "Write a Python function that adds two numbers."
NEW_TOKENS = 16
NEAR_TIE = 1e-3


def local_yaml_adapters() -> dict[str, str]:
    local = Path(__file__).resolve().parents[2] / "deployments" / "local.yaml"
    args = yaml.safe_load(local.read_text())["applications"][0]["args"]
    return next(t for t in args["targets"] if t["name"] == BASE)["lora"]["adapters"]


@pytest.fixture(scope="module")
def lora_real_app(serve_instance):
    from s2d_ray.serve import build_app

    cfg = {
        # calibration off: the test proves the served draft path exact, so it must draft (see conftest.real_app)
        "targets": [{"name": BASE, "num_cpus": 0.25, "dtype": "float32", "calibration": "off",
                     "lora": {"adapters": local_yaml_adapters(), "max_loaded": 4, "max_rank": 16}}],
        "draft": {"source": real_draft_source(), "num_cpus": 0.25, "dtype": "float32"},
        "router": {"num_cpus": 0.25},
        "num_threads": 1,
        "api_key": "test-key-0123",
    }
    yield deploy(build_app(cfg), "reallora", serve_instance, cfg)
    undeploy("reallora")


@pytest.fixture(scope="module")
def merged() -> tuple[dict[str, torch.nn.Module], list[int]]:
    """The base and each adapter merged into it (fp32), and the chat-encoded prompt."""
    from peft import PeftModel

    from s2d_ray.build import load_target
    from s2d_ray.config import EngineConfig, TargetConfig
    from s2d_ray.prompts import encode_prompt
    from s2d_ray.serve.lora_config import adapter_path

    loaded = load_target(EngineConfig(target=TargetConfig(name=BASE, dtype="float32")))
    models = {BASE: loaded.model.eval()}
    for name, where in local_yaml_adapters().items():
        peft = PeftModel.from_pretrained(copy.deepcopy(loaded.model), str(adapter_path(where)))
        models[name] = peft.merge_and_unload().eval()
    return models, encode_prompt(loaded.tokenizer, PROMPT, chat=True)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def equal_or_near_tie(got: list[int], want: list[int], model, prompt: list[int]) -> None:
    if got == want:
        return
    at = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
    with torch.no_grad():
        top = model(torch.tensor([prompt + want[:at]])).logits[0, -1].topk(2).values
    assert float(top[0] - top[1]) < NEAR_TIE, f"differs at token {at}, not a near-tie"


def test_local_yaml_adapters_served_each_equal_their_merged_model(lora_real_app, merged):
    models, prompt = merged
    assert len(models) >= 3, list(models)  # the base and local.yaml's two adapters

    def complete(model: str) -> dict:
        r = post(f"{lora_real_app.url}/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()

    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:  # every model's rows in flight together
        bodies = dict(zip(models, pool.map(complete, models)))
    got = {name: body["choices"][0]["token_ids"] for name, body in bodies.items()}
    assert sum(b["metrics"]["speculative_decoding"]["num_draft_tokens"] for b in bodies.values()) > 0
    want = {name: greedy(model, prompt, NEW_TOKENS) for name, model in models.items()}
    for name, model in models.items():
        equal_or_near_tie(got[name], want[name], model, prompt)
    assert all(want[a] != want[b] for a in models for b in models if a != b), want  # the wrong adapter would fail
