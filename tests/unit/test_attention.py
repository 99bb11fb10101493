"""The CPU's grouped-query attention equals SDPA (float64), with additive, bool, per-head and causal masks, with
either innermost kernel (grouped matmuls, or torch's SDPA where it measures faster)."""

from __future__ import annotations

import itertools

import pytest
import torch

from s2d_ray.core.attention import plan_kv_groups
from s2d_ray.kernels import GROUPED, CpuKernels
from s2d_ray.kernels.attention import CPU_GROUPED
from s2d_ray.kernels.attention import cpu_grouped_attention as grouped_attention  # the CPU's sizes


def sdpa(query, key, value, mask, scaling):
    g = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    if mask is None and query.shape[2] > 1:
        q, k = query.shape[2], key.shape[2]
        mask = torch.ones(q, k, dtype=torch.bool).tril(k - q)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2)


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("q,k", [(1, 7), (5, 12), (6, 6)])
@pytest.mark.parametrize("kind", ["additive", "additive_heads", "bool", "none"])
def test_grouped_attention_equals_sdpa(q, k, kind, kernel):
    gen = torch.Generator().manual_seed(q * 31 + k)
    b, h, kvh, d = 3, 6, 2, 8
    query = torch.randn(b, h, q, d, generator=gen, dtype=torch.float64)
    key = torch.randn(b, kvh, k, d, generator=gen, dtype=torch.float64)
    value = torch.randn(b, kvh, k, d, generator=gen, dtype=torch.float64)
    allowed = torch.rand(b, 1, q, k, generator=gen) < 0.7
    allowed[..., 0] = True  # every query sees something
    mask = {"additive": torch.zeros(b, 1, q, k, dtype=torch.float64).masked_fill(~allowed, -1e300),
            "additive_heads": torch.zeros(b, h, q, k, dtype=torch.float64).masked_fill(~allowed.expand(b, h, q, k),
                                                                                        -1e300),
            "bool": allowed, "none": None}[kind]
    got, _ = grouped_attention(None, query, key, value, mask, scaling=0.3, sdpa=kernel)
    want = sdpa(query, key, value, mask, 0.3)
    assert got.shape == (b, q, h, d)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_a_swapped_group_order_would_differ():
    """Queries of head i must meet KV head i // g (Hugging Face's repeat_kv order); interleaving them is caught."""
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 3, 8, generator=gen, dtype=torch.float64)
    key = torch.randn(1, 2, 5, 8, generator=gen, dtype=torch.float64)
    got, _ = grouped_attention(None, query, key, key, None)
    swapped = query[:, [0, 2, 1, 3]]
    bad, _ = grouped_attention(None, swapped, key, key, None)
    assert not torch.allclose(got, bad[:, :, [0, 2, 1, 3]])
    torch.testing.assert_close(got, sdpa(query, key, key, None, None))


def test_engine_layers_use_grouped_and_transformers_baselines_get_stock_sdpa():
    """The CPU backend routes the layers (their model's own config) to grouped attention; the stock default leaves
    them as they are."""
    from core_fixtures import tiny_target
    from s2d_ray.bench.methods import HFGenerate
    from s2d_ray.core.target import TargetVerifier
    from s2d_ray.core.types import SamplingParams

    model = tiny_target(seed=1)
    assert not TargetVerifier(model).stack.grouped and model.config._attn_implementation == "sdpa"
    assert TargetVerifier(model, kernels=CpuKernels()).stack.grouped
    assert model.config._attn_implementation == GROUPED
    seen = []
    layer = model.model.layers[0].self_attn
    hook = layer.register_forward_pre_hook(lambda mod, args: seen.append(mod.config._attn_implementation))
    HFGenerate(model, None).generate([5, 6, 7], 3, SamplingParams())
    hook.remove()
    assert seen and set(seen) == {"sdpa"}  # what a transformers user runs
    assert model.config._attn_implementation == GROUPED  # restored for the engine


@pytest.mark.parametrize("kernel", [False, True])
def test_kv_groups_attend_each_row_over_its_own_slots_and_equal_one_group(kernel):
    """Rows of 3, 11, 4, 20 visible slots (their masks say so) in groups over only their own longest: the output
    equals one group over all 20; a group cut short of a row's visible slots differs (the check can fail)."""
    gen = torch.Generator().manual_seed(5)
    b, h, kvh, q, d, k = 4, 6, 2, 2, 8, 20
    lengths = [3, 11, 4, 20]
    query = torch.randn(b, h, q, d, generator=gen, dtype=torch.float64)
    key = torch.randn(b, kvh, k, d, generator=gen, dtype=torch.float64)
    value = torch.randn(b, kvh, k, d, generator=gen, dtype=torch.float64)
    allowed = torch.arange(k)[None, None, None, :] < torch.tensor(lengths)[:, None, None, None]
    allowed = allowed & (torch.rand(b, 1, q, k, generator=gen) < 0.8)
    allowed[..., 0] = True
    mask = torch.zeros(b, 1, q, k, dtype=torch.float64).masked_fill(~allowed, -1e300)
    want, _ = grouped_attention(None, query, key, value, mask)
    plan = plan_kv_groups(lengths, overhead=0)
    assert sorted(i for g in plan for i in g) == [0, 1, 2, 3] and len(plan) > 1
    groups = [(torch.tensor(g), max(lengths[i] for i in g)) for g in plan]
    got, _ = grouped_attention(None, query, key, value, mask, kv_groups=groups, sdpa=kernel)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    short = [(torch.tensor(g), max(lengths[i] for i in g) - (3 in g)) for g in plan]  # the 20-slot row sees 19
    bad, _ = grouped_attention(None, query, key, value, mask, kv_groups=short, sdpa=kernel)
    assert not torch.allclose(bad, want)


@pytest.mark.parametrize("seed", range(20))
def test_kv_group_plan_is_the_cheapest_split(seed):
    """The planner's groups cost no more than any split of the length-sorted rows (brute force, cuts inside runs of
    equal length included), and cover every row once; equal lengths or a high overhead keep one group (None)."""
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 7, (1,), generator=gen))
    lengths = torch.randint(1, 900 if seed % 2 else 4, (n,), generator=gen).tolist()  # odd seeds: runs of one length
    overhead = int(torch.randint(0, 1500, (1,), generator=gen))

    def cost(groups):
        return sum(overhead + len(g) * max(lengths[i] for i in g) for g in groups)

    order = sorted(range(n), key=lambda i: lengths[i])
    best = min(cost([order[a:b] for a, b in zip((0, *cuts), (*cuts, n))])
               for r in range(n) for cuts in itertools.combinations(range(1, n), r))
    plan = plan_kv_groups(lengths, overhead)
    assert cost(plan or [order]) == best
    if plan is not None:
        assert sorted(i for g in plan for i in g) == list(range(n))
    assert plan_kv_groups([7] * n, 0) is None and plan_kv_groups(lengths, 10**9) is None


def test_prompt_passes_in_query_blocks_equal_one_block(monkeypatch):
    """A causal pass of 11 queries over 30 slots in blocks of 4, each block over keys up to its last allowed one,
    equals one block (float64), bool and additive masks; a block that dropped an allowed key would differ."""
    from dataclasses import replace

    gen = torch.Generator().manual_seed(9)
    b, h, kvh, q, d, k = 2, 6, 2, 11, 8, 30
    query = torch.randn(b, h, q, d, generator=gen, dtype=torch.float64)
    key = torch.randn(b, kvh, k, d, generator=gen, dtype=torch.float64)
    value = torch.randn(b, kvh, k, d, generator=gen, dtype=torch.float64)
    allowed = torch.ones(q, k, dtype=torch.bool).tril(k - q - 5)[None, None].expand(b, 1, q, k).clone()
    masks = [allowed, torch.zeros(b, 1, q, k, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)]
    for mask in masks:
        want, _ = grouped_attention(None, query, key, value, mask)
        got, _ = grouped_attention(None, query, key, value, mask, tuning=replace(CPU_GROUPED, query_block=4))
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert not torch.allclose(got, grouped_attention(None, query, key[:, :, :-6], value[:, :, :-6], mask)[0])


def test_the_faster_kernel_is_chosen_per_kind_of_pass_and_reaches_the_layers(monkeypatch):
    """`sdpa_cases` picks SDPA for a kind of pass only when it measures a quarter faster there (a slowed kernel loses
    either way, and each kind of pass goes to its own faster kernel); a stack built with the choice passes SDPA to
    exactly the layer calls of those kinds, and greedy decoding is the same with any choice."""
    import time

    import s2d_ray.core.attention as attention
    from core_fixtures import random_prompts, tiny_target
    from s2d_ray.core.engine import SpecEngine
    from s2d_ray.core.kernels import ATTENTION_CASES, attention_case
    from s2d_ray.core.target import TargetVerifier
    from s2d_ray.kernels.attention import sdpa_cases
    from test_engine_exact import run

    real = attention.attend

    def slowed(slow_sdpa):  # slow_sdpa(kind of pass): True slows SDPA there, False the grouped matmuls
        def attend(q, k, v, m, scale, kernel, key_left_max):
            if kernel == slow_sdpa(attention_case(q.shape[0], q.shape[2])):
                time.sleep(0.002)
            return real(q, k, v, m, scale, kernel, key_left_max)
        return attend

    measure = sdpa_cases.__wrapped__  # not the per-process cache; no store: this process's measurement alone
    monkeypatch.setattr(attention, "attend", slowed(lambda case: True))
    assert measure(4, 2, 8, torch.float64, slots=32, repeats=3) == frozenset()
    monkeypatch.setattr(attention, "attend", slowed(lambda case: False))
    assert measure(4, 2, 8, torch.float64, slots=32, repeats=3) == frozenset(ATTENTION_CASES)
    monkeypatch.setattr(attention, "attend", slowed(lambda case: case != "tree"))
    assert measure(4, 2, 8, torch.float64, slots=32, repeats=3) == {"tree"}
    monkeypatch.setattr(attention, "attend", real)

    seen, outs = [], {}
    for kernel in ("grouped", "sdpa", "trees"):
        model = tiny_target(seed=3)
        chosen = {"grouped": frozenset(), "sdpa": frozenset(ATTENTION_CASES), "trees": frozenset({"tree"})}[kernel]
        monkeypatch.setattr("s2d_ray.kernels.cpu.sdpa_cases", lambda *a, **k: chosen)
        verifier = TargetVerifier(model, kernels=CpuKernels(attention_kernel="auto"))
        assert verifier.stack.sdpa_cases == chosen
        hook = model.model.layers[0].self_attn.register_forward_pre_hook(
            lambda mod, args, kwargs: seen.append(
                (kernel, attention_case(*kwargs["hidden_states"].shape[:2]), kwargs.get("sdpa", False))),
            with_kwargs=True)
        engine = SpecEngine(verifier)
        prompts = random_prompts(2, seed=4) + random_prompts(1, seed=5, lo=40, hi=48)  # one longer than a tree
        outs[kernel] = [[o.token_ids for o in run(engine, prompts, 12, batch=batch)]
                        for batch in (True, False)]
        hook.remove()
    for kernel, case, sdpa in seen:
        assert sdpa is (kernel == "sdpa" or kernel == "trees" and case == "tree"), (kernel, case)
    assert {case for _, case, _ in seen} == set(ATTENTION_CASES)
    assert outs["grouped"] == outs["sdpa"] == outs["trees"]


def test_the_backends_sizes_reach_the_layers():
    """A stack hands its backend's GroupedTuning to every grouped layer call (not the CPU sizes the bare attention
    function falls back to), and a grouped kernel without sizes is refused."""
    from dataclasses import replace

    from core_fixtures import tiny_target
    from s2d_ray.core.kernels import AttentionKernel
    from s2d_ray.core.target import TargetVerifier
    from s2d_ray.core.types import ScoreRequest

    tuning = replace(CPU_GROUPED, query_block=4, group_overhead_slots=0)
    model = tiny_target(seed=3)
    verifier = TargetVerifier(model, kernels=CpuKernels(attention_kernel="grouped", tuning=tuning))
    seen = []
    hook = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs.get("tuning")), with_kwargs=True)
    verifier.score([ScoreRequest("s0", list(range(1, 12)), 1)])
    hook.remove()
    assert seen and all(t == tuning for t in seen)
    with pytest.raises(ValueError, match="GroupedTuning"):
        AttentionKernel(grouped=True)
