"""The slot cache counts passes whose rows were not one in-order range (each layer then gathers their K/V): what the
target's served stats report as `num_gathered_passes`."""

from __future__ import annotations

import torch

from core_fixtures import random_prompts, tiny_target
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.types import ScoreRequest


def test_passes_over_rows_apart_are_counted_as_gathered():
    verifier = TargetVerifier(tiny_target(seed=1))
    prompts = random_prompts(3, seed=2)
    verifier.score([ScoreRequest(f"s{i}", p, 1) for i, p in enumerate(prompts)])  # rows 0, 1, 2: one range
    assert (verifier.cache.num_passes, verifier.cache.num_gathered) == (1, 0)
    verifier.release("s1")
    out = verifier.score([ScoreRequest(f"s{i}", prompts[i] + [5], 1) for i in (0, 2)])  # rows 0 and 2: apart
    assert (verifier.cache.num_passes, verifier.cache.num_gathered) == (2, 1)
    with torch.no_grad():  # and the gathered pass is still exact
        ref = verifier.model(torch.tensor([prompts[2] + [5]])).logits[0, -1]
    torch.testing.assert_close(out[1][0], ref, rtol=1e-9, atol=1e-9)
    verifier.score([ScoreRequest("s3", prompts[1], 1)])  # takes the freed row 1
    tokens = {"s0": prompts[0] + [5, 6], "s3": prompts[1] + [6], "s2": prompts[2] + [5, 6]}
    verifier.score([ScoreRequest(s, t, 1) for s, t in tokens.items()])  # rows 0, 1, 2 again: a view
    assert (verifier.cache.num_passes, verifier.cache.num_gathered) == (4, 1)
