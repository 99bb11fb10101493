"""Per-row LoRA in the verifier (core/lora.py): each row's adapter applied in one batched forward is exactly that
adapter merged into the base (peft merge_and_unload), greedy and sampled, over one unadapted sorted draft."""

from __future__ import annotations

import pytest
import torch

from core_fixtures import KERNELS, noisy_draft, random_prompts, tiny_target
from helpers import make_tiny_llama, merge_lora, save_random_lora
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.lora import AdapterError, LoraBank
from s2d_ray.core.policy import FixedK
from s2d_ray.core.prefix_cache import PrefixCacheSpec
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.types import SamplingParams
from s2d_ray.models.adapters import read_peft_adapter

@pytest.fixture(scope="module")
def family(tmp_path_factory):
    base = tiny_target(seed=0)
    root = tmp_path_factory.mktemp("adapters")
    a = save_random_lora(base, root / "a", seed=1)
    b = save_random_lora(base, root / "b", seed=2, r=2, modules=["q_proj", "v_proj", "down_proj"], rslora=True)
    return base, {"a": a, "b": b}, {"a": merge_lora(base, a), "b": merge_lora(base, b), "": base}


def lora_verifier(base, adapters, max_loaded: int = 4, prefix_cache: PrefixCacheSpec | None = None) -> TargetVerifier:
    bank = LoraBank(max_loaded=max_loaded, max_rank=8)
    verifier = TargetVerifier(base, kernels=KERNELS, lora=bank, prefix_cache=prefix_cache)
    for name, path in adapters.items():
        bank.register(read_peft_adapter(path, name))
    return verifier


def requests(prompts, names, n: int, params: SamplingParams = SamplingParams(),
             merged_model: bool = False) -> list[GenerationRequest]:
    """Rows named `<adapter>-<prompt index>`; on a merged model the same rows name no adapter."""
    return [GenerationRequest(f"{name or 'base'}-{i}", p, n, params, adapter="" if merged_model else name)
            for name in names for i, p in enumerate(prompts)]


def prompts_with_shared_head():
    """Prompts whose first 32+ tokens repeat across rows: the verifier forks such prefixes (rows.FREE_WIDTH)."""
    head = random_prompts(1, seed=9, lo=40, hi=41)[0]
    return random_prompts(3, seed=5) + [head + [7, 8], head + [9]]


def reference(models, prompts, names, n, params=SamplingParams(), draft=None):
    """Each adapter's rows decoded on its merged model alone (plain, or S2D with the same draft)."""
    out = {}
    for name in names:
        drafter = SortedDrafter(draft) if draft is not None else None
        engine = SpecEngine(TargetVerifier(models[name], kernels=KERNELS), drafter, policy=FixedK(4))
        for res in engine.generate(requests(prompts, [name], n, params, merged_model=True)):
            out[res.seq_id] = res.token_ids
    return out


def test_each_adapter_greedy_equals_its_merged_model(family):
    base, paths, models = family
    prompts, names = prompts_with_shared_head(), ["a", "b", ""]
    expected = reference(models, prompts, names, 24)
    engine = SpecEngine(lora_verifier(base, paths), SortedDrafter(noisy_draft(base)), policy=FixedK(4))
    got = {r.seq_id: r.token_ids for r in engine.generate(requests(prompts, names, 24))}
    assert got == expected
    # The adapters must change the output, or equality above proves nothing.
    for i in range(len(prompts)):
        assert len({tuple(expected[f"{name or 'base'}-{i}"]) for name in names}) == 3
    drafted = sum(r.metrics["num_draft_tokens"] for r in engine.generate(requests(prompts[:1], ["a"], 16)))
    assert drafted > 0  # the unadapted draft speculated for the adapted rows
    assert engine.verifier.table.num_forked_tokens > 0  # shared heads were forked, within each adapter


def test_sampling_equals_merged_models_engine(family):
    base, paths, models = family
    prompts, names = random_prompts(3, seed=3), ["a", "b", ""]
    params = SamplingParams(temperature=0.9, seed=11)
    draft = noisy_draft(base)
    expected = reference(models, prompts, names, 20, params, draft)
    engine = SpecEngine(lora_verifier(base, paths), SortedDrafter(draft), policy=FixedK(4))
    got = {r.seq_id: r.token_ids for r in engine.generate(requests(prompts, names, 20, params))}
    assert got == expected


def test_wrong_adapter_on_a_row_fails(family, monkeypatch):
    """Negative control: every row given the first adapter's slot (a gather that ignores the row) is caught."""
    base, paths, models = family
    prompts, names = random_prompts(3, seed=4), ["a", "b"]
    expected = reference(models, prompts, names, 16)
    bind = LoraBank.bind
    monkeypatch.setattr(LoraBank, "bind", lambda self, rows, device: bind(self, [rows[0]] * len(rows), device))
    engine = SpecEngine(lora_verifier(base, paths), SortedDrafter(noisy_draft(base)), policy=FixedK(4))
    got = {r.seq_id: r.token_ids for r in engine.generate(requests(prompts, names, 16))}
    assert got != expected


def test_least_recently_used_adapter_gives_its_slot_up(family):
    base, paths, models = family
    prompts = random_prompts(2, seed=6)
    verifier = lora_verifier(base, paths, max_loaded=1)
    engine = SpecEngine(verifier, SortedDrafter(noisy_draft(base)), policy=FixedK(3))
    for name in ["a", "b", "a"]:  # each call evicts the other adapter and loads its own back
        got = {r.seq_id: r.token_ids for r in engine.generate(requests(prompts, [name], 12))}
        assert got == reference(models, prompts, [name], 12)
        assert list(verifier.lora.slots) == [name]
    with pytest.raises(ValueError, match="at most 1 resident"):
        engine.generate(requests(prompts, ["a", "b"], 4, SamplingParams()))


def test_reregistered_adapter_never_reuses_old_kv(family, tmp_path):
    """A name loaded again with other weights: rows it computed before are not forked from (the key changed)."""
    base, paths, models = family
    verifier = lora_verifier(base, {"x": paths["a"]}, prefix_cache=PrefixCacheSpec(max_tokens=1024, min_tokens=8))
    prompt = random_prompts(1, seed=9, lo=40, hi=41)[0]
    engine = SpecEngine(verifier)
    engine.generate([GenerationRequest("first", prompt, 4, adapter="x")])
    verifier.lora.register(read_peft_adapter(paths["b"], "x"))
    assert len(verifier.table.prefix_cache) == 1  # the first row's KV is kept for forks
    out = engine.generate([GenerationRequest("second", prompt, 8, adapter="x")])[0].token_ids
    assert verifier.table.num_forked_tokens == 0
    assert out == reference(models, [prompt], ["b"], 8)["b-0"]


def test_bad_adapters_are_refused_with_the_reason(family, tmp_path):
    base, paths, _ = family
    bank = LoraBank(max_loaded=2, max_rank=2)
    TargetVerifier(base, kernels=KERNELS, lora=bank)
    with pytest.raises(AdapterError, match="rank 4 exceeds"):
        bank.register(read_peft_adapter(paths["a"], "a"))
    other = save_random_lora(make_tiny_llama(vocab_size=96, hidden_size=48, dtype=torch.float64), tmp_path / "o", 3, r=2)
    with pytest.raises(AdapterError, match="another base"):
        bank.register(read_peft_adapter(other, "o"))
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_peft_adapter(tmp_path / "missing")
    assert bank.registered == {}  # nothing half-registered
    with pytest.raises(ValueError, match="not loaded"):
        SpecEngine(TargetVerifier(base, kernels=KERNELS, lora=bank)).generate(
            [GenerationRequest("s", [5, 6, 7], 2, adapter="nope")])
    with pytest.raises(ValueError, match="serves no adapters"):
        SpecEngine(TargetVerifier(base, kernels=KERNELS)).generate([GenerationRequest("s", [5, 6], 2, adapter="a")])


def test_base_model_is_untouched_by_wrapping(family):
    base, paths, _ = family
    ids = torch.tensor([random_prompts(1, seed=2)[0]])
    before = base(ids).logits
    lora_verifier(base, paths)
    assert torch.equal(base(ids).logits, before)
    assert not any("lora" in type(m).__name__.lower() for m in base.modules())
