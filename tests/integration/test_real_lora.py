"""The committed GSM8K adapter served per row over real SmolLM2-135M-Instruct (fp32), with the committed sorted draft:
greedy S2D equals the adapter merged into the base (peft) decoded plainly, except at fp32 near-ties (the unmerged sum
rounds differently from merged weights), which are detected by the merged model's top-2 logit gap."""

from __future__ import annotations

import copy

import pytest
import torch

from s2d_ray.build import build_draft, load_profile, load_target
from s2d_ray.config import DraftConfig, EngineConfig, TargetConfig
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.lora import LoraBank
from s2d_ray.core.policy import FixedK
from s2d_ray.core.target import TargetVerifier
from s2d_ray.kernels import CpuKernels
from s2d_ray.models.adapters import read_peft_adapter
from s2d_ray.prompts import encode_prompt
from s2d_ray.serve.lora_config import adapter_path

pytestmark = pytest.mark.real

KERNELS = CpuKernels()
PROMPTS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
           "clips did Natalia sell altogether in April and May?", "What is 17 * 23?"]
NEAR_TIE = 1e-3


def equal_or_near_tie(got: list[int], want: list[int], model, prompt: list[int]) -> None:
    if got == want:
        return
    at = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
    with torch.no_grad():
        top = model(torch.tensor([prompt + want[:at]])).logits[0, -1].topk(2).values
    assert float(top[0] - top[1]) < NEAR_TIE, f"differs at token {at}, not a near-tie"


def test_gsm8k_adapter_per_row_equals_the_merged_target():
    from peft import PeftModel

    cfg = EngineConfig(target=TargetConfig(name="smollm2-135m-instruct", dtype="float32"),
                       draft=DraftConfig(source="smollm2-135m-s2d"), num_threads=1)
    loaded = load_target(cfg)
    base, tok = loaded.model, loaded.tokenizer
    path = adapter_path("smollm2-135m-gsm8k")
    merged = PeftModel.from_pretrained(copy.deepcopy(base), str(path)).merge_and_unload().eval()
    bank = LoraBank(max_loaded=1, max_rank=8)
    draft = build_draft(cfg, loaded, load_profile(cfg))
    engine = SpecEngine(TargetVerifier(base, kernels=KERNELS, lora=bank), SortedDrafter(draft), policy=FixedK(4))
    bank.register(read_peft_adapter(path, "gsm8k"))
    plain = SpecEngine(TargetVerifier(merged, kernels=KERNELS))
    base_plain = SpecEngine(TargetVerifier(base, kernels=KERNELS))
    prompts = [encode_prompt(tok, p, chat=True) for p in PROMPTS]
    got = engine.generate([GenerationRequest(f"a{i}", p, 32, adapter="gsm8k") for i, p in enumerate(prompts)] +
                          [GenerationRequest(f"b{i}", p, 32) for i, p in enumerate(prompts)])
    want = plain.generate([GenerationRequest(f"a{i}", p, 32) for i, p in enumerate(prompts)])
    want_base = base_plain.generate([GenerationRequest(f"b{i}", p, 32) for i, p in enumerate(prompts)])
    for res, ref, prompt in zip(got[:2], want, prompts):
        equal_or_near_tie(res.token_ids, ref.token_ids, merged, prompt)
    for res, ref, prompt in zip(got[2:], want_base, prompts):  # base rows verified in the same forwards
        equal_or_near_tie(res.token_ids, ref.token_ids, base, prompt)
    assert [r.token_ids for r in want] != [r.token_ids for r in want_base]  # the adapter changes the output
    assert sum(r.metrics["num_accepted_draft_tokens"] for r in got) > 0


def local_yaml_adapters() -> dict[str, str]:
    """The adapters deployments/local.yaml serves over its instruct target (model name -> adapter)."""
    from pathlib import Path

    import yaml

    local = Path(__file__).resolve().parents[2] / "deployments" / "local.yaml"
    app = yaml.safe_load(local.read_text())["applications"][0]["args"]
    base = next(t for t in app["targets"] if t.get("lora"))
    assert base["name"] == "smollm2-135m-instruct"
    return base["lora"]["adapters"]


def test_local_yaml_adapters_each_equal_their_merged_target():
    """Both adapters of local.yaml (the GSM8K one and the code one trained with `s2d train-lora`) and base rows in
    the same forwards, one sorted draft for all: each row's greedy output equals its own adapter merged and decoded
    plainly. Negative control: the adapters' merged outputs differ from each other and from the base, so a row
    verified under the wrong adapter (or none) fails."""
    from peft import PeftModel

    adapters = local_yaml_adapters()
    assert len(adapters) >= 2, adapters
    cfg = EngineConfig(target=TargetConfig(name="smollm2-135m-instruct", dtype="float32"),
                       draft=DraftConfig(source="smollm2-135m-s2d"), num_threads=1)
    loaded = load_target(cfg)
    base, tok = loaded.model, loaded.tokenizer
    bank = LoraBank(max_loaded=len(adapters), max_rank=16)
    engine = SpecEngine(TargetVerifier(base, kernels=KERNELS, lora=bank), SortedDrafter(build_draft(
        cfg, loaded, load_profile(cfg))), policy=FixedK(4))
    prompts = [encode_prompt(tok, p, chat=True) for p in ("Write a Python function that reverses a string.",
                                                          PROMPTS[1])]
    want: dict[str, list[list[int]]] = {}
    merged: dict[str, torch.nn.Module] = {"": base}
    for name, where in adapters.items():
        bank.register(read_peft_adapter(adapter_path(where), name))
        merged[name] = PeftModel.from_pretrained(copy.deepcopy(base), str(adapter_path(where))).merge_and_unload()
    for name, model in merged.items():
        plain = SpecEngine(TargetVerifier(model.eval(), kernels=KERNELS))
        want[name] = [r.token_ids for r in plain.generate([GenerationRequest(f"{name}{i}", p, 24)
                                                           for i, p in enumerate(prompts)])]
    rows = [(name, i) for name in merged for i in range(len(prompts))]
    got = engine.generate([GenerationRequest(f"{name}/{i}", prompts[i], 24, adapter=name) for name, i in rows])
    for (name, i), res in zip(rows, got):
        equal_or_near_tie(res.token_ids, want[name][i], merged[name], prompts[i])
    names = list(merged)
    assert all(want[a] != want[b] for a in names for b in names if a != b), want  # the wrong adapter would fail
    assert sum(r.metrics["num_accepted_draft_tokens"] for r in got) > 0
