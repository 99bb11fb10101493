"""Wide passes (prompts, big batches) run on `wide_threads` intra-op threads, narrow ones on the thread's own count;
the count is restored after every pass (also when a pass raises) and the output is unchanged."""

from __future__ import annotations

import pytest
import torch

from core_fixtures import noisy_draft, random_prompts, tiny_target
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.policy import FixedK
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.threads import WIDE_PASS_POSITIONS, intra_op_threads, pass_threads
from s2d_ray.core.types import ScoreRequest
from test_engine_exact import reference_greedy


def spy_threads(stack) -> list[tuple[int, int]]:
    """(positions, intra-op threads) seen by the first layer in every pass through `stack`."""
    seen: list[tuple[int, int]] = []
    stack.layers[0].register_forward_pre_hook(
        lambda _m, args: seen.append((args[0].shape[0] * args[0].shape[1], torch.get_num_threads())))
    return seen


def test_intra_op_threads_sets_and_restores():
    assert torch.get_num_threads() == 1
    with intra_op_threads(2):
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 1
    with pytest.raises(RuntimeError), intra_op_threads(2):
        raise RuntimeError("a failed pass")
    assert torch.get_num_threads() == 1
    with intra_op_threads(None):
        assert torch.get_num_threads() == 1
    assert pass_threads(2, WIDE_PASS_POSITIONS) == 2
    assert pass_threads(2, WIDE_PASS_POSITIONS - 1) is None
    assert pass_threads(None, 10_000) is None


def test_verifier_runs_prompts_wide_and_decode_narrow_with_equal_logits():
    prompt = torch.randint(3, 96, (80,), generator=torch.Generator().manual_seed(4)).tolist()
    rounds = [[ScoreRequest("a", prompt, 1)], [ScoreRequest("a", prompt + [5, 6], 2)]]
    plain, wide = TargetVerifier(tiny_target(seed=2)), TargetVerifier(tiny_target(seed=2), wide_threads=2)
    seen = spy_threads(wide.stack)
    for reqs in rounds:
        for a, b in zip(plain.score(reqs), wide.score(reqs)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert seen == [(80, 2), (2, 1)]  # the prompt pass on 2 threads, the decode pass on the thread's own 1
    assert torch.get_num_threads() == 1


def test_engine_with_wide_threads_stays_exact():
    """Draft and target both wide: prompts of 70+ positions cross the line, decode rounds do not."""
    target = tiny_target(seed=5)
    drafter = SortedDrafter(noisy_draft(target), wide_threads=2)
    engine = SpecEngine(TargetVerifier(target, wide_threads=2), drafter, policy=FixedK(3))
    prompts = [p * 6 for p in random_prompts(3, seed=8, lo=12)]
    expected = [reference_greedy(target, p, 12) for p in prompts]
    draft_seen, target_seen = spy_threads(drafter.stack), spy_threads(engine.verifier.stack)
    outs = engine.generate([GenerationRequest(f"s{i}", p, 12) for i, p in enumerate(prompts)])
    assert [out.token_ids for out in outs] == expected
    for seen in (draft_seen, target_seen):
        assert {t for n, t in seen if n >= WIDE_PASS_POSITIONS} == {2}
        assert {t for n, t in seen if n < WIDE_PASS_POSITIONS} == {1}
