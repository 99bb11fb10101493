"""The CPU backend's thread policy (kernels/threads.py): wide passes (prompts, big batches) run on `wide_threads`
intra-op threads, narrow ones on the thread's own count; the count is restored after every pass (also when a pass
raises) and the output is unchanged. The deterministic backend runs every pass on one fixed count."""

from __future__ import annotations

import pytest
import torch

from core_fixtures import noisy_draft, random_prompts, tiny_target
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.kernels import PlainPasses
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.policy import FixedK
from s2d_ray.core.target import TargetVerifier
from s2d_ray.kernels import CpuKernels, DeterministicKernels
from s2d_ray.kernels.threads import WIDE_PASS_POSITIONS, CpuPasses, FixedPasses, intra_op_threads, pass_threads
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
    plain = TargetVerifier(tiny_target(seed=2))
    wide = TargetVerifier(tiny_target(seed=2), kernels=CpuKernels(wide_threads=2))
    seen = spy_threads(wide.stack)
    for reqs in rounds:
        for a, b in zip(plain.score(reqs), wide.score(reqs)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert seen == [(80, 2), (2, 1)]  # the prompt pass on 2 threads, the decode pass on the thread's own 1
    assert torch.get_num_threads() == 1


def test_engine_with_wide_threads_stays_exact():
    """Draft and target both wide: prompts of 70+ positions cross the line, decode rounds do not."""
    target = tiny_target(seed=5)
    wide = CpuKernels(wide_threads=2)
    drafter = SortedDrafter(noisy_draft(target, kernels=wide))
    engine = SpecEngine(TargetVerifier(target, kernels=wide), drafter, policy=FixedK(3))
    prompts = [p * 6 for p in random_prompts(3, seed=8, lo=12)]
    expected = [reference_greedy(target, p, 12) for p in prompts]
    draft_seen, target_seen = spy_threads(drafter.stack), spy_threads(engine.verifier.stack)
    outs = engine.generate([GenerationRequest(f"s{i}", p, 12) for i, p in enumerate(prompts)])
    assert [out.token_ids for out in outs] == expected
    for seen in (draft_seen, target_seen):
        assert {t for n, t in seen if n >= WIDE_PASS_POSITIONS} == {2}
        assert {t for n, t in seen if n < WIDE_PASS_POSITIONS} == {1}


def test_backends_give_each_stack_its_own_runner():
    cpu = torch.device("cpu")
    adaptive = CpuKernels(wide_threads=2, adaptive_threads=True)
    first, second = adaptive.passes(cpu), adaptive.passes(cpu)
    assert isinstance(first, CpuPasses) and first.governor is not None and first.governor is not second.governor
    assert CpuKernels().passes(cpu).governor is None
    assert isinstance(CpuKernels(adaptive_threads=True).passes(torch.device("meta")), PlainPasses)  # no CPU threads
    assert isinstance(DeterministicKernels().passes(cpu), FixedPasses)


def test_deterministic_backend_runs_wide_and_narrow_passes_on_one_count():
    """A GEMM's reduction split may follow the thread count: the mode keeps a prompt pass on the decode step's count,
    where the CPU backend with wide_threads would not (the negative control)."""
    prompt = torch.randint(3, 96, (80,), generator=torch.Generator().manual_seed(4)).tolist()
    rounds = [[ScoreRequest("a", prompt, 1)], [ScoreRequest("a", prompt + [5, 6], 2)]]
    with intra_op_threads(2):
        fixed = TargetVerifier(tiny_target(seed=2), kernels=DeterministicKernels())
        wide = TargetVerifier(tiny_target(seed=2), kernels=CpuKernels(wide_threads=1))
        fixed_seen, wide_seen = spy_threads(fixed.stack), spy_threads(wide.stack)
        for reqs in rounds:
            fixed.score(reqs)
            wide.score(reqs)
    assert {t for _, t in fixed_seen} == {2}
    assert wide_seen == [(80, 1), (2, 2)]  # negative control: the wide pass on another count than decode
