"""Several-row projections on packed weights (core/linear.py): the same numbers as the stock kernel (one row: the
very same), the model's own modules untouched, the choice measured per shape, and speculation still lossless."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import s2d_ray.core.linear as linear
import s2d_ray.core.stack as stack
from core_fixtures import noisy_draft, random_prompts, tiny_target
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import SpecEngine
from s2d_ray.core.linear import PackedLinear, with_packed_linears
from s2d_ray.core.policy import FixedK
from s2d_ray.core.target import TargetVerifier
from test_engine_exact import reference_greedy, run

pytestmark = pytest.mark.skipif(not linear.supported(torch.float32), reason="no oneDNN packed fp32 linear here")


@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_stock_and_one_row_is_the_stock_kernel(bias):
    gen = torch.Generator().manual_seed(0)
    weight = nn.Parameter(torch.randn(48, 40, generator=gen), requires_grad=False)
    b = torch.randn(48, generator=gen) if bias else None
    packed = PackedLinear(weight, b)
    with torch.no_grad():
        for shape in [(0, 40), (1, 40), (1, 1, 40), (2, 40), (3, 40), (1, 8, 40), (4, 5, 40)]:
            x = torch.randn(*shape, generator=gen)
            want = nn.functional.linear(x, weight, b)
            got = packed(x)
            assert got.shape == want.shape
            if x.numel() <= 40:
                assert torch.equal(got, want)  # a decode step's row runs exactly what it ran before
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packed_copy_follows_weight_updates_and_autograd_takes_the_stock_kernel():
    weight = nn.Parameter(torch.randn(32, 16))
    packed = PackedLinear(weight)
    x = torch.randn(4, 16)
    with torch.no_grad():
        before = packed(x)
        weight.mul_(2.0)  # an in-place update (an optimiser step, load_state_dict) bumps the version
        torch.testing.assert_close(packed(x), 2 * before, rtol=1e-5, atol=1e-5)
    out = packed(x)  # grad enabled and the weight trains: the differentiable stock kernel
    out.sum().backward()
    torch.testing.assert_close(weight.grad, x.sum(0).expand(32, 16))


def test_the_model_keeps_its_modules_and_the_copy_shares_every_parameter():
    model = tiny_target(seed=2).to(torch.float32)
    layer = model.model.layers[0]
    copy = with_packed_linears(layer, lambda lin: lin.out_features > 32)
    assert copy is not layer and type(layer.mlp.up_proj) is nn.Linear  # the original is untouched
    assert isinstance(copy.mlp.up_proj, PackedLinear) and copy.mlp.up_proj.weight is layer.mlp.up_proj.weight
    assert copy.input_layernorm is layer.input_layernorm  # nothing to pack below it: shared, not copied
    assert list(copy.state_dict()) == list(layer.state_dict())
    assert all(a is b for a, b in zip(copy.parameters(), layer.parameters()))


def test_the_choice_is_measured_per_shape(monkeypatch):
    model = tiny_target(seed=2).to(torch.float32)
    monkeypatch.setattr(stack, "LINEAR_KERNEL", "auto")
    monkeypatch.setattr(stack, "packed_is_faster", lambda out_f, in_f, dtype, threads: out_f == 96)  # the LM head only
    verifier = TargetVerifier(model)
    assert verifier.stack.packed_linears == 1 and isinstance(verifier.stack.parts.head, PackedLinear)
    monkeypatch.setattr(stack, "packed_is_faster", lambda *a: False)
    assert TargetVerifier(model).stack.packed_linears == 0
    monkeypatch.setattr(stack, "LINEAR_KERNEL", "packed")
    assert TargetVerifier(tiny_target(seed=2)).stack.packed_linears == 0  # float64: oneDNN has no kernel, never packed


def test_the_measurement_follows_the_faster_kernel(monkeypatch):
    import time
    from types import SimpleNamespace

    measure = linear.packed_is_faster.__wrapped__  # not the per-process cache
    real_packed, real_stock = linear._packed_linear, linear.F.linear

    def slow_packed(x, p, b):
        time.sleep(0.001)
        return real_packed(x, p, b)

    def slow_stock(x, w, b=None):
        time.sleep(0.001)
        return real_stock(x, w, b)

    monkeypatch.setattr(linear, "_packed_linear", slow_packed)
    assert measure(64, 32, torch.float32, 1, 2) is False
    monkeypatch.setattr(linear, "_packed_linear", real_packed)
    monkeypatch.setattr(linear, "F", SimpleNamespace(linear=slow_stock))
    assert measure(64, 32, torch.float32, 1, 2) is True


def test_greedy_speculation_with_packed_projections_equals_target_greedy(monkeypatch):
    """fp32 target and draft with every projection packed (trees and chains verify several rows; drafting batches
    rows): output equals the slow reference and the stock-kernel engine token for token."""
    model = tiny_target(seed=0).to(torch.float32)
    prompts = random_prompts(4, seed=5)
    outs = {}
    for kernel in ("stock", "packed"):
        monkeypatch.setattr(stack, "LINEAR_KERNEL", kernel)
        verifier, drafter = TargetVerifier(model), SortedDrafter(noisy_draft(model))
        assert (verifier.stack.packed_linears > 0) is (kernel == "packed")
        assert (drafter.stack.packed_linears > 0) is (kernel == "packed")
        outs[kernel] = [r.token_ids for r in run(SpecEngine(verifier, drafter, FixedK(4)), prompts, 24, batch=True)]
    assert outs["packed"] == outs["stock"]
    assert outs["packed"] == [reference_greedy(model, p, 24) for p in prompts]
    assert type(model.model.layers[0].mlp.up_proj) is nn.Linear  # transformers' own forward keeps the stock kernel
