"""Projections on packed weights (kernels/linear.py): the same numbers as the stock kernel (one row without its MKL
copy: the very same), the model's own modules untouched, each choice measured per shape, and speculation still
lossless."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import s2d_ray.kernels.cpu as cpu
import s2d_ray.kernels.linear as linear
from core_fixtures import noisy_draft, random_prompts, tiny_target
from s2d_ray.core.draft import SortedDraft, SortedDrafter
from s2d_ray.core.engine import SpecEngine
from s2d_ray.core.policy import FixedK
from s2d_ray.core.target import TargetVerifier
from s2d_ray.kernels import CpuKernels
from s2d_ray.kernels.linear import PackedLinear, with_packed_linears
from test_engine_exact import reference_greedy, run

pytestmark = pytest.mark.skipif(not linear.supported(torch.float32), reason="no oneDNN packed fp32 linear here")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("one_row", [False, True])
def test_packed_equals_stock_and_one_row_follows_its_choice(bias, one_row, monkeypatch):
    if one_row and not linear.one_row_supported(torch.float32):
        pytest.skip("no MKL one-row packed GEMM here")
    gen = torch.Generator().manual_seed(0)
    weight = nn.Parameter(torch.randn(48, 40, generator=gen), requires_grad=False)
    b = torch.randn(48, generator=gen) if bias else None
    packed = PackedLinear(weight, b, several=True, one_row=one_row)
    one_row_calls = []
    real = linear._one_row_linear
    monkeypatch.setattr(linear, "_one_row_linear", lambda *args: one_row_calls.append(1) or real(*args))
    with torch.no_grad():
        for shape in [(0, 40), (1, 40), (40,), (1, 1, 40), (2, 40), (3, 40), (1, 8, 40), (4, 5, 40)]:
            x = torch.randn(*shape, generator=gen)
            want = nn.functional.linear(x, weight, b)
            got = packed(x)
            assert got.shape == want.shape
            if x.numel() <= 40 and not one_row:
                assert torch.equal(got, want)  # one row without its copy: exactly the stock kernel
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(one_row_calls) == (3 if one_row else 0)  # the three one-row shapes, and only those


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
    copy = with_packed_linears(layer, lambda lin: (lin.out_features > 32, False))
    assert copy is not layer and type(layer.mlp.up_proj) is nn.Linear  # the original is untouched
    assert isinstance(copy.mlp.up_proj, PackedLinear) and copy.mlp.up_proj.weight is layer.mlp.up_proj.weight
    assert copy.input_layernorm is layer.input_layernorm  # nothing to pack below it: shared, not copied
    assert list(copy.state_dict()) == list(layer.state_dict())
    assert all(a is b for a, b in zip(copy.parameters(), layer.parameters()))


def packed_counts(holder) -> tuple[int, int]:
    """(projections packed for several rows, for one row) of a verifier's or drafter's stack, as stats report them."""
    kernels = holder.stack.kernels()
    return kernels.get("packed_several", 0), kernels.get("packed_one_row", 0)


def test_the_choice_is_measured_per_shape(monkeypatch):
    model = tiny_target(seed=2).to(torch.float32)
    monkeypatch.setattr(cpu, "packed_is_faster", lambda out_f, in_f, dtype, threads, store: out_f == 96)  # LM head
    monkeypatch.setattr(cpu, "one_row_is_faster", lambda out_f, in_f, dtype, threads, store: out_f == 64)  # MLP up
    verifier = TargetVerifier(model, kernels=CpuKernels("auto"))
    head, up = verifier.stack.parts.head, verifier.stack.layers[0].mlp.up_proj
    assert isinstance(head, PackedLinear) and head.several and not head.one_row
    assert isinstance(up, PackedLinear) and up.one_row and not up.several
    n_layers = len(verifier.stack.layers)
    assert packed_counts(verifier) == (1, 2 * n_layers)
    assert packed_counts(TargetVerifier(model, kernels=CpuKernels("several"))) == (1, 0)  # one row stays stock
    monkeypatch.setattr(cpu, "packed_is_faster", lambda *a: False)
    monkeypatch.setattr(cpu, "one_row_is_faster", lambda *a: False)
    assert packed_counts(TargetVerifier(model, kernels=CpuKernels("auto"))) == (0, 0)
    float64 = TargetVerifier(tiny_target(seed=2), kernels=CpuKernels("packed"))
    assert packed_counts(float64) == (0, 0)  # float64: oneDNN has no kernel, never packed
    assert TargetVerifier(model).stack.kernels() == {"attention": "sdpa-masked"}  # the stock default: the model's own


def test_the_setting_is_checked_and_the_environment_overrides_it(tmp_path, monkeypatch):
    from s2d_ray.errors import ConfigError

    with pytest.raises(ConfigError, match="expected one of auto, several, stock, packed"):
        CpuKernels("fast")
    monkeypatch.delenv(cpu.ENV_LINEAR_KERNEL, raising=False)
    monkeypatch.delenv("S2D_KERNEL_TIMES", raising=False)  # the suite's own file would override `off`
    assert CpuKernels.from_settings("several", "off", tmp_path / "t.json") == CpuKernels("several")
    monkeypatch.setenv(cpu.ENV_LINEAR_KERNEL, "stock")
    assert CpuKernels.from_settings("several", "off", tmp_path / "t.json").linear == "stock"


def test_the_measurement_follows_the_faster_kernel(monkeypatch):
    import time
    from types import SimpleNamespace

    measure = linear.packed_is_faster.__wrapped__  # not the per-process cache; no store: this measurement alone
    real_packed, real_stock = linear._packed_linear, linear.F.linear

    def slow_packed(x, p, b):
        time.sleep(0.001)
        return real_packed(x, p, b)

    def slow_stock(x, w, b=None):
        time.sleep(0.001)
        return real_stock(x, w, b)

    monkeypatch.setattr(linear, "_packed_linear", slow_packed)
    assert measure(64, 32, torch.float32, 1, repeats=2) is False
    monkeypatch.setattr(linear, "_packed_linear", real_packed)
    monkeypatch.setattr(linear, "F", SimpleNamespace(linear=slow_stock))
    assert measure(64, 32, torch.float32, 1, repeats=2) is True


@pytest.mark.skipif(not linear.one_row_supported(torch.float32), reason="no MKL one-row packed GEMM here")
def test_the_one_row_measurement_follows_the_faster_kernel_and_the_memory_cap(monkeypatch):
    import time
    from types import SimpleNamespace

    measure = linear.one_row_is_faster.__wrapped__  # no store: this process's measurement alone
    real_one, real_stock = linear._one_row_linear, linear.F.linear

    def slow_one(*args):
        time.sleep(0.001)
        return real_one(*args)

    def slow_stock(x, w, b=None):
        time.sleep(0.001)
        return real_stock(x, w, b)

    monkeypatch.setattr(linear, "ONE_ROW_MAX_COPY", float("inf"))  # MKL's copy of a small weight is far larger
    monkeypatch.setattr(linear, "_one_row_linear", slow_one)
    assert measure(64, 32, torch.float32, 1, repeats=2) is False
    monkeypatch.setattr(linear, "_one_row_linear", real_one)
    monkeypatch.setattr(linear, "F", SimpleNamespace(linear=slow_stock))
    assert measure(64, 32, torch.float32, 1, repeats=2) is True
    monkeypatch.setattr(linear, "ONE_ROW_MAX_COPY", 2.5)  # the cap as shipped: a small weight's copy is far over it
    assert measure(64, 32, torch.float32, 1, repeats=2) is False
    assert measure(64, 32, torch.float64, 1, repeats=2) is False  # fp32 only


def test_greedy_speculation_with_packed_projections_equals_target_greedy():
    """fp32 target and draft with every projection packed (trees and chains verify several rows; drafting batches
    rows): output equals the slow reference and the stock-kernel engine token for token."""
    model = tiny_target(seed=0).to(torch.float32)
    prompts = random_prompts(4, seed=5)
    outs = {}
    for kernel in ("stock", "packed"):
        kernels = CpuKernels(kernel)
        verifier = TargetVerifier(model, kernels=kernels)
        draft = noisy_draft(model)
        drafter = SortedDrafter(SortedDraft(draft.parts, draft.spec, draft.layers, kernels=kernels))
        several, one_row = packed_counts(verifier)
        assert (several > 0) is (kernel == "packed") and (sum(packed_counts(drafter)) > 0) is (kernel == "packed")
        assert (one_row > 0) is (kernel == "packed" and linear.one_row_supported(torch.float32))
        # What the served stats report: every projection of the target (7 a layer) and its head, or none.
        stats = verifier.stack.kernels()
        assert stats["packed_several"] == (7 * len(verifier.stack.layers) + 1 if kernel == "packed" else 0)
        assert [part.split(":")[0] for part in stats["attention"].split(",")] == ["decode", "tree", "prompt", "batch"]
        outs[kernel] = [r.token_ids for r in run(SpecEngine(verifier, drafter, FixedK(4)), prompts, 24, batch=True)]
    assert outs["packed"] == outs["stock"]
    assert outs["packed"] == [reference_greedy(model, p, 24) for p in prompts]
    assert type(model.model.layers[0].mlp.up_proj) is nn.Linear  # transformers' own forward keeps the stock kernel
