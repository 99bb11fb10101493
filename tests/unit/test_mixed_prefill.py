"""Prompt chunks ride in the decode rows' forward (core/mixed.py) and long prompts fill over several rounds under a
per-round token budget: logits and greedy output equal unchunked, a running stream keeps emitting every round while
a long prompt joins, and a chunk that attends past its own position is caught."""

from __future__ import annotations

import pytest
import torch

import s2d_ray.core.target as target_mod
from core_fixtures import KERNELS, noisy_draft, random_prompts, tiny_target
from s2d_ray.core.budget import SpeculationBudget, TreeShape
from s2d_ray.core.costs import CostModel
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.mixed import fold_plan, pieces, round_prompt_positions
from s2d_ray.core.policy import FixedK
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.types import ScoreRequest
from test_engine_exact import reference_greedy
from test_length_groups import spy_forwards


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_fold_plan_and_pieces():
    # decode rows of 1-4 positions, a 100-position chunk folds into 4 pieces of 25; a 900-position prompt runs apart
    width, folded, rest = fold_plan([4, 100, 1, 900], [True] * 4)
    assert (width, folded, rest) == (25, [1], [3])
    assert [(p.index, p.start, p.end) for p in pieces([10, 0, 7], [13, 99, 7], folded, width)] == \
        [(0, 10, 13), (1, 0, 24), (1, 25, 49), (1, 50, 74), (1, 75, 99), (2, 7, 7)]
    assert fold_plan([4, 4, 3], [True] * 3) is None  # nothing to fold
    assert fold_plan([4, 100], [True, False]) is None  # a tree row is never cut
    assert round_prompt_positions([50, 200, 30], 120) == [50, 70, 0]


def scored(mix: bool, chunk_view: bool = False) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """Three calls to one verifier: two prompts, then decode rows beside a 100-position chunk of a third prompt (with
    `chunk_view`, its tokens so far only), then its rest beside the next decode rows."""
    verifier = TargetVerifier(tiny_target(seed=7), mix_prompts=mix, kernels=KERNELS)
    shapes = spy_forwards(verifier.stack)
    a, b, c = prompt(20, 1), prompt(12, 2), prompt(150, 3)
    out = verifier.score([ScoreRequest("a", a, 1), ScoreRequest("b", b, 1)])
    out += verifier.score([ScoreRequest("a", a + [5, 6, 7], 3), ScoreRequest("b", b + [4, 9], 2),
                           ScoreRequest("c", c[:100], 1)])
    out += verifier.score([ScoreRequest("a", a + [5, 6, 7, 8], 1), ScoreRequest("b", b + [4, 9, 1], 1),
                           ScoreRequest("c", c, 3)])
    return out, shapes


def test_mixed_forward_equals_separate_forwards():
    apart, apart_shapes = scored(mix=False)
    mixed, mixed_shapes = scored(mix=True)
    for x, y in zip(apart, mixed):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)
    assert len(mixed_shapes) < len(apart_shapes)  # one forward per round once a chunk joins decode rows
    assert max(w for _, w in mixed_shapes[1:]) < 100  # the chunk rode in pieces, decode rows were not padded to it


def test_chunk_attending_past_its_position_is_caught(monkeypatch):
    good, _ = scored(mix=True)
    # wrong: a piece's queries see every slot of the round (the later pieces of their own chunk, stale slots)
    monkeypatch.setattr(target_mod, "piece_allowed",
                        lambda positions, kv_len: torch.ones(*positions.shape, kv_len, dtype=torch.bool))
    broken, _ = scored(mix=True)
    assert any(not torch.allclose(x, y) for x, y in zip(good, broken))


def staggered(engine: SpecEngine, short: list[list[int]], long: list[int], n: int, join: int = 3):
    """Short prompts decode; the long one joins at round `join`. Returns outputs and, per round, who emitted."""
    for i, p in enumerate(short):
        engine.add_request(GenerationRequest(f"s{i}", p, n))
    out: dict[str, list[int]] = {f"s{i}": [] for i in range(len(short))} | {"long": []}
    emitted: list[set[str]] = []
    for step in range(400):
        if step == join:
            engine.add_request(GenerationRequest("long", long, n))
        got = engine.step()
        emitted.append({o.seq_id for o in got if o.new_tokens})
        for o in got:
            out[o.seq_id] += o.new_tokens
        if not engine.has_unfinished:
            break
    return out, emitted


@pytest.mark.parametrize("spec", [False, True])
def test_chunked_prompts_keep_streams_running_and_outputs_exact(spec):
    target = tiny_target(seed=3)
    short, long = random_prompts(3, seed=4), prompt(180, 5)
    verifier = TargetVerifier(target, kernels=KERNELS)
    shapes = spy_forwards(verifier.stack)
    drafter = SortedDrafter(noisy_draft(target)) if spec else None
    engine = SpecEngine(verifier, drafter, FixedK(3), prompt_tokens=40)
    out, emitted = staggered(engine, short, long, 30)
    for i, p in enumerate(short):
        assert out[f"s{i}"] == reference_greedy(target, p, 30)
    assert out["long"] == reference_greedy(target, long, 30)
    # the long prompt took ceil(180 / 40) = 5 rounds to fill, and every one of them emitted for the running streams
    joined = next(i for i, e in enumerate(emitted) if "long" in e)
    assert joined == 3 + 4
    assert all({"s0", "s1", "s2"} <= emitted[r] for r in range(3, joined + 1))
    assert max(w for _, w in shapes) < 60  # no round carried the whole prompt


def test_without_a_prompt_budget_the_long_prompt_stalls_the_round():
    """The control: prompt_tokens=0 fills the whole prompt in the round it joins (one forward as wide as it)."""
    target = tiny_target(seed=3)
    verifier = TargetVerifier(target, kernels=KERNELS)
    shapes = spy_forwards(verifier.stack)
    out, emitted = staggered(SpecEngine(verifier, None, FixedK(3)), random_prompts(3, seed=4), prompt(180, 5), 12)
    assert "long" in emitted[3]
    assert max(w for _, w in shapes) >= 180


def test_budget_prices_the_chunk_on_the_cost_grid():
    flat = CostModel({1: {1: 10.0, 64: 12.0, 128: 20.0, 256: 40.0}, 8: {1: 11.0}})
    budget = SpeculationBudget(TreeShape(), flat, max_depth=4)
    # a round may cost two plain steps of its batch: verify(1, 1 + P) <= 20 ms -> P = 127
    assert budget.prompt_positions(1, 512) == 127
    assert budget.prompt_positions(8, 512) == 132  # verify(8, 1) = 11 ms: 22 ms buys a few more positions
    assert budget.prompt_positions(1, 16) == 16  # never more than asked
    steep = SpeculationBudget(TreeShape(), CostModel({1: {1: 10.0, 2: 30.0}}), max_depth=4)
    assert steep.prompt_positions(1, 512) == SpeculationBudget.MIN_PROMPT_POSITIONS  # a prompt always progresses

