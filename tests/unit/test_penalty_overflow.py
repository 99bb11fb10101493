"""A repetition penalty near 0 divides positive logits into overflow: the result stays finite, so the sampler's
softmax has no NaN, and the penalised token still wins (the limit the tiny penalty stands for)."""

from __future__ import annotations

import torch

from s2d_ray.core.penalties import RepetitionPenalty
from s2d_ray.core.types import SamplingParams


def test_a_tiny_repetition_penalty_keeps_logits_finite_and_sampleable():
    logits = torch.tensor([[2.0, 1.0, -1.0, float("-inf")]])
    out = RepetitionPenalty(5e-324)([0, 2], [[]], logits)
    assert torch.isfinite(out[0, :3]).all() and out[0, 3] == float("-inf")  # a ban stays a ban
    assert out[0].argmax() == 0
    probs = torch.softmax(out / SamplingParams(temperature=1e-5).temperature, -1)
    assert not torch.isnan(probs).any() and probs[0, 0] == 1.0
    # negative control: the unclamped rule overflows, and the softmax of it is NaN
    raw = torch.where(logits > 0, logits / 5e-324, logits * 5e-324)
    assert torch.isnan(torch.softmax(raw, -1)).any()
