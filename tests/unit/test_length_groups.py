"""Prompts are not padded into decode forwards: a long prompt joining running sequences gets its own forward, and
outputs stay exactly the target's greedy."""

from __future__ import annotations

import torch

from core_fixtures import noisy_draft, random_prompts, tiny_target
from s2d_ray.core.budget import SpeculationBudget, TreeShape
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.lookup import PromptLookup, TreeDrafter
from s2d_ray.core.policy import FixedK
from s2d_ray.core.rows import length_groups
from s2d_ray.core.target import TargetVerifier
from test_engine_exact import reference_greedy


def test_groups_keep_similar_lengths_together():
    # decode rows (1..25) share a forward; prompts of 900 and 880 share one; 500 goes alone.
    assert length_groups([1, 900, 25, 3, 880, 500, 5]) == [[1, 4], [5], [0, 2, 3, 6]]
    assert length_groups([4, 4, 4]) == [[0, 1, 2]]
    assert length_groups([]) == []
    assert length_groups([40, 1], free_width=64) == [[0, 1]]


def spy_forwards(stack) -> list[tuple[int, int]]:
    """Record (rows, width) of every forward through `stack`."""
    shapes: list[tuple[int, int]] = []
    original = stack.run_segment

    def run_segment(seg, x, *args, **kwargs):
        shapes.append(tuple(x.shape[:2]))
        return original(seg, x, *args, **kwargs)

    stack.run_segment = run_segment
    return shapes


def test_long_prompt_joining_decode_rows_runs_apart_and_stays_exact():
    target = tiny_target(seed=3)
    verifier = TargetVerifier(target)
    drafter = TreeDrafter(SortedDrafter(noisy_draft(target)), PromptLookup())
    engine = SpecEngine(verifier, drafter, FixedK(3), budget=SpeculationBudget(TreeShape(width=3, lookup=True, max_nodes=12), None, max_depth=6))
    target_shapes, draft_shapes = spy_forwards(verifier.stack), spy_forwards(drafter.draft.stack)
    short = random_prompts(3, seed=4)
    long = torch.randint(3, 96, (120,), generator=torch.Generator().manual_seed(5)).tolist()
    for i, p in enumerate(short):
        engine.add_request(GenerationRequest(f"s{i}", p, 30))
    out: dict[str, list[int]] = {f"s{i}": [] for i in range(3)} | {"long": []}
    for step in range(200):
        if step == 3:  # the others are decoding now
            engine.add_request(GenerationRequest("long", long, 30))
        for o in engine.step():
            out[o.seq_id] += o.new_tokens
        if not engine.has_unfinished:
            break
    for i, p in enumerate(short):
        assert out[f"s{i}"] == reference_greedy(target, p, 30)
    assert out["long"] == reference_greedy(target, long, 30)
    for shapes in (target_shapes, draft_shapes):
        assert any(w >= 120 for _, w in shapes)  # the prompt was filled ...
        assert all(rows == 1 for rows, w in shapes if w >= 100)  # ... never with decode rows padded to its length
