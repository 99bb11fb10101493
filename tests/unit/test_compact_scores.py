"""A remote verifier ships argmax ids, not [n, V] logits, for greedy rows that ask no logprobs; outputs unchanged."""

from __future__ import annotations

import pytest

from core_fixtures import random_prompts, tiny_target
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.sampling import compact_scores
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.types import SamplingParams
from s2d_ray.serve.replica import score_counted
from test_engine_exact import reference_greedy
from test_trees import tree_engine


class Shipped:
    """The verifier as the router sees it through a target deployment: what `score_counted` returns."""

    def __init__(self, verifier: TargetVerifier) -> None:
        self.verifier, self.shapes = verifier, []

    def score(self, requests):
        out, _ = score_counted(self.verifier, requests, [0] * len(requests))
        self.shapes += [(r.argmax_only, tuple(x.shape)) for r, x in zip(requests, out)]
        return out

    def release(self, seq_id):
        self.verifier.release(seq_id)


@pytest.mark.parametrize("trees", [False, True])
def test_greedy_rows_ship_ids_and_outputs_equal_target_greedy(trees):
    target = tiny_target(seed=0)
    engine = tree_engine(target, 3, True) if trees else SpecEngine(TargetVerifier(target))
    shipped = Shipped(engine.verifier)
    engine.verifier = shipped
    prompts = random_prompts(4, seed=2)
    reqs = [GenerationRequest(f"g{i}", p, 24) for i, p in enumerate(prompts)]
    reqs.append(GenerationRequest("lp", prompts[0], 24, logprobs=2))  # logprobs need the full rows
    reqs.append(GenerationRequest("s", prompts[1], 24, SamplingParams(temperature=0.8, seed=3)))  # so does sampling
    out = {r.seq_id: r for r in engine.generate(reqs)}
    for i, p in enumerate(prompts):
        assert out[f"g{i}"].token_ids == reference_greedy(target, p, 24)
    assert out["lp"].token_ids == reference_greedy(target, prompts[0], 24)
    assert all(len(shape) == 1 for flag, shape in shipped.shapes if flag)  # ids, [num_logits]
    assert all(len(shape) == 2 for flag, shape in shipped.shapes if not flag)  # logits, [num_logits, V]
    assert sum(flag for flag, _ in shipped.shapes) > 0 and sum(not flag for flag, _ in shipped.shapes) > 0


def test_compact_scores_keeps_the_first_argmax():
    import torch

    logits = torch.tensor([[0.0, 2.0, 2.0], [5.0, 1.0, 5.0]])
    assert compact_scores(logits, True).tolist() == [1, 0]  # torch's tie rule, the same as the engine's own argmax
    assert compact_scores(logits, False) is logits
