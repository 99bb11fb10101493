"""The CPU's grouped-query attention equals SDPA (float64), with additive, bool, per-head and causal masks."""

from __future__ import annotations

import pytest
import torch

from s2d_ray.core.attention import grouped_attention


def sdpa(query, key, value, mask, scaling):
    g = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    if mask is None and query.shape[2] > 1:
        q, k = query.shape[2], key.shape[2]
        mask = torch.ones(q, k, dtype=torch.bool).tril(k - q)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2)


@pytest.mark.parametrize("q,k", [(1, 7), (5, 12), (6, 6)])
@pytest.mark.parametrize("kind", ["additive", "additive_heads", "bool", "none"])
def test_grouped_attention_equals_sdpa(q, k, kind):
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
    got, _ = grouped_attention(None, query, key, value, mask, scaling=0.3)
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
    from core_fixtures import tiny_target
    from s2d_ray.bench.methods import HFGenerate
    from s2d_ray.core.attention import GROUPED
    from s2d_ray.core.target import TargetVerifier
    from s2d_ray.core.types import SamplingParams

    model = tiny_target(seed=1)
    TargetVerifier(model)
    assert model.config._attn_implementation == GROUPED
    seen = []
    layer = model.model.layers[0].self_attn
    hook = layer.register_forward_pre_hook(lambda mod, args: seen.append(mod.config._attn_implementation))
    HFGenerate(model, None).generate([5, 6, 7], 3, SamplingParams())
    hook.remove()
    assert seen and set(seen) == {"sdpa"}  # what a transformers user runs
    assert model.config._attn_implementation == GROUPED  # restored for the engine
