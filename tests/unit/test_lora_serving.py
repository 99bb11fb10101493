"""The serving side of LoRA targets without Ray: the `lora:` config, forwards split by resident adapters, and a
replica's answers in request order whatever the split."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from core_fixtures import KERNELS, random_prompts, tiny_target
from helpers import merge_lora, save_random_lora
from s2d_ray.core.engine import GenerationRequest
from s2d_ray.core.lora import LoraBank
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.types import ScoreRequest
from s2d_ray.serve.app_config import AppConfig
from s2d_ray.serve.lora import adapter_parts, register_adapter, score_by_adapters
from s2d_ray.serve.lora_config import ASSET_ADAPTERS, adapter_path


def rows(*names: str) -> list[ScoreRequest]:
    return [ScoreRequest(f"s{i}", [1, 2, 3], 1, adapter=n) for i, n in enumerate(names)]


def test_parts_hold_at_most_max_loaded_adapters():
    parts = adapter_parts(rows("a", "", "b", "c", "a", "", "d", "c"), max_loaded=2)
    assert parts == [[0, 1, 2, 4, 5], [3, 6, 7]]
    assert adapter_parts(rows("a", "b", ""), max_loaded=2) == [[0, 1, 2]]
    assert adapter_parts(rows("", ""), max_loaded=1) == [[0, 1]]


def test_split_forwards_answer_in_request_order(tmp_path):
    base = tiny_target(seed=0)
    paths = {n: save_random_lora(base, tmp_path / n, seed=i + 1) for i, n in enumerate("abc")}
    bank = LoraBank(max_loaded=1, max_rank=4)
    verifier = TargetVerifier(base, kernels=KERNELS, lora=bank)
    for n, p in paths.items():
        assert register_adapter(bank, n, str(p)) == {"loaded": n}
    prompts = random_prompts(4, seed=2)
    names = ["a", "b", "", "c"]
    reqs = [ScoreRequest(f"s{i}", p, 1, adapter=n) for i, (p, n) in enumerate(zip(prompts, names))]
    out, _ = score_by_adapters(verifier, reqs, [0] * 4)  # three forwards: one adapter resident at a time
    for p, n, logits in zip(prompts, names, out):
        model = merge_lora(base, paths[n]) if n else base
        want = model(torch.tensor([p])).logits[0, -1]
        assert torch.allclose(logits[-1], want, atol=1e-9)


def test_register_reports_errors_instead_of_raising(tmp_path):
    assert "no adapter_config.json" in register_adapter(LoraBank(), "x", str(tmp_path))["error"]
    assert "serves no LoRA" in register_adapter(None, "x", str(tmp_path))["error"]


def target(**lora) -> dict:
    return {"name": "base", "source": "smollm2-135m-instruct", "lora": lora}


def test_config_accepts_the_committed_adapter_by_name():
    cfg = AppConfig.model_validate({"targets": [target(adapters={"gsm8k": "smollm2-135m-gsm8k"})]})
    assert cfg.targets[0].lora.adapters == {"gsm8k": "smollm2-135m-gsm8k"}
    assert adapter_path("smollm2-135m-gsm8k") == ASSET_ADAPTERS / "smollm2-135m-gsm8k"


def test_config_accepts_adapters_on_a_tensor_parallel_target():
    cfg = AppConfig.model_validate({"targets": [{**target(adapters={"gsm8k": "smollm2-135m-gsm8k"}), "tp_size": 3}]})
    assert cfg.targets[0].tp_size == 3 and cfg.targets[0].lora.adapters == {"gsm8k": "smollm2-135m-gsm8k"}


@pytest.mark.parametrize("spec, fragment", [
    ({"targets": [target(adapters={"x": "/no/such/dir"})]}, "not a peft adapter directory"),
    ({"targets": [target(adapters={"base": "smollm2-135m-gsm8k"})]}, "must be unique"),
    ({"targets": [target(adapters={"bad name!": "smollm2-135m-gsm8k"})]}, "adapter name"),
    ({"targets": [target(max_loaded=0)]}, "max_loaded"),
])
def test_config_errors_name_the_problem(spec, fragment):
    with pytest.raises(ValidationError, match=fragment):
        AppConfig.model_validate(spec)


def test_an_adapter_named_like_a_calibrated_target_takes_its_thresholds():
    from s2d_ray.serve.lora import RouterAdapters

    cfg = AppConfig.model_validate({"targets": [
        {"name": "smollm2-135m-instruct", "dtype": "float32",
         "lora": {"adapters": {"smollm2-135m-gsm8k": "smollm2-135m-gsm8k", "plain": "smollm2-135m-gsm8k"}}}]})
    adapters = RouterAdapters(cfg)
    assert set(adapters.thresholds) == {"smollm2-135m-gsm8k"}  # the committed profile's; none for "plain"
    base, gen = adapters.generation("smollm2-135m-gsm8k", GenerationRequest("s", [1], 4))
    assert base == "smollm2-135m-instruct" and gen.adapter == "smollm2-135m-gsm8k"
    assert gen.draft_thresholds == adapters.thresholds["smollm2-135m-gsm8k"]
    assert adapters.generation("smollm2-135m-instruct", GenerationRequest("s", [1], 4))[1].adapter == ""


def test_a_path_the_os_refuses_is_an_error_not_a_crash():
    from s2d_ray.core.lora import LoraBank

    assert "error" in register_adapter(LoraBank(), "x", "bad\x00path")  # answered, never raised


def test_a_target_placed_in_the_router_is_one_replica_for_loads():
    """placement: router (local.yaml's instruct target): the in-process handle answers a load once, itself."""
    import asyncio

    from s2d_ray.serve.lora import RouterAdapters
    from s2d_ray.serve.replica import InProcessHandle

    class Placed:
        async def load_adapter(self, name, where, affinity=None):
            return {"loaded": name, "replica": "router-0", "affinity": affinity}

    replies = asyncio.run(RouterAdapters.on_every_replica(InProcessHandle(Placed()), "load_adapter", "x", "/p"))
    assert replies == [{"loaded": "x", "replica": "router-0", "affinity": None}]
