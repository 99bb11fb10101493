"""Segment forwards padded to shape buckets (and captured as CUDA graphs on a GPU) stay exact.

On the CPU the padded forwards run eagerly (`use_graphs(capture=False)`): every padding rule is checked here, in CI.
On CUDA (scripts/gpu_check.sh) the same tests capture and replay graphs, and check that replays happened.
"""

from __future__ import annotations

import pytest
import torch

import s2d_ray.core.graphs as graphs_mod
from core_fixtures import random_prompts
from s2d_ray.core.draft import SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.policy import FixedK
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.types import ScoreRequest
from test_devices import generate, pair, repetitive, tree_engine  # noqa: F401 - `pair` is a fixture

__all__ = ["pair"]


def graphed(engine: SpecEngine) -> SpecEngine:
    """Turn bucketed forwards on for the engine's target and draft stacks (captured on CUDA, eager on the CPU)."""
    engine.verifier.stack.use_graphs()
    drafter = engine.drafter
    drafter = getattr(drafter, "draft", None) if not isinstance(drafter, SortedDrafter) else drafter  # TreeDrafter
    if drafter is not None:
        drafter.stack.use_graphs()
    return engine


def replays(engine: SpecEngine) -> int:
    return engine.verifier.stack.graphs.replays


def verifiers(target, kernels, **kwargs) -> tuple[TargetVerifier, TargetVerifier]:
    """An eager verifier and one whose forwards are padded to buckets (captured on CUDA), on the same kernels."""
    eager, padded = (TargetVerifier(target, cuda_graphs=False, kernels=kernels, **kwargs) for _ in range(2))
    padded.stack.use_graphs()
    return eager, padded


def test_graphed_verifier_logits_equal_eager_round_by_round(pair):
    target, draft, device = pair
    eager, padded = verifiers(target, draft.kernels)
    padded.stack.use_graphs()
    prompts = random_prompts(3, seed=2)  # 3 rows pad to 4: one pad row shares the last real row
    seqs = [list(p) for p in prompts]
    for step in range(6):
        width = 1 + step % 3  # 1-3 positions per row: pads within rows too
        for s in seqs:
            s.extend([7 + step] * width)
        reqs = [ScoreRequest(f"s{i}", s, width) for i, s in enumerate(seqs)]
        for a, b in zip(eager.score(reqs), padded.score(reqs)):
            assert torch.allclose(a, b, atol=1e-9, rtol=0), step
    if device.type == "cuda":
        assert padded.stack.graphs.replays > 0


@pytest.mark.parametrize("mode", ["ar", "s2d"])
def test_graphed_engine_equals_target_greedy(pair, mode):
    target, draft, device = pair
    prompts = random_prompts(5, seed=11, lo=2, hi=30)  # mixed lengths: 5 rows pad to 8
    ar = generate(SpecEngine(TargetVerifier(target, cuda_graphs=False, kernels=draft.kernels)), prompts, 32)
    engine = SpecEngine(TargetVerifier(target, kernels=draft.kernels), SortedDrafter(draft) if mode == "s2d" else None,
                        policy=FixedK(4))
    assert generate(graphed(engine), prompts, 32) == ar
    if device.type == "cuda":
        assert replays(engine) > 0


@pytest.mark.parametrize("width,frontier", [(3, 0), (3, 3)], ids=["tree+lookup", "frontier"])
def test_graphed_trees_equal_target_greedy(pair, width, frontier):
    """Tree masks and RoPE positions go through the static buffers too (target and draft)."""
    target, draft, device = pair
    prompts = random_prompts(3, seed=5) + repetitive(random_prompts(2, seed=6, lo=4, hi=9))
    ar = generate(SpecEngine(TargetVerifier(target, cuda_graphs=False, kernels=draft.kernels)), prompts, 40)
    engine = graphed(tree_engine(target, draft, width, frontier))
    out = engine.generate([GenerationRequest(f"s{i}", p, 40) for i, p in enumerate(prompts)])
    assert [o.token_ids for o in out] == ar
    if device.type == "cuda":
        assert replays(engine) > 0


def score_gaps(target, kernels, steps: int = 4) -> float:
    """Largest |logit difference| of a padded verifier against an eager one over a few rounds of 3 rows."""
    eager, padded = verifiers(target, kernels)
    seqs = [list(p) for p in random_prompts(3, seed=2)]
    gap = 0.0
    for step in range(steps):
        for s in seqs:
            s.append(7 + step)
        reqs = [ScoreRequest(f"s{i}", s, 1) for i, s in enumerate(seqs)]
        gap = max(gap, max(float((a - b).abs().max()) for a, b in zip(eager.score(reqs), padded.score(reqs))))
    return gap


def test_pad_rows_on_live_slots_would_fail(pair, monkeypatch):
    """Negative control: pad rows that write at the last real row's first slots (live KV) change its logits."""
    target, draft, _ = pair
    assert score_gaps(target, draft.kernels) < 1e-9
    fill = graphs_mod.SegmentGraphs._fill

    def bad_fill(self, slot, x, rows, positions, rope, allowed, n, w, s):
        fill(self, slot, x, rows, positions, rope, allowed, n, w, s)
        slot.positions[n:] = torch.arange(slot.positions.shape[1], device=slot.positions.device)
        slot.rope[n:] = slot.positions[n:]

    monkeypatch.setattr(graphs_mod.SegmentGraphs, "_fill", bad_fill)
    assert score_gaps(target, draft.kernels) > 1e-3


def test_calls_beyond_the_largest_bucket_run_eagerly(pair):
    target, draft, _ = pair
    eager_verifier, verifier = verifiers(target, draft.kernels, prefill_chunk=0)
    long_prompt = [(5 * i) % 90 + 3 for i in range(graphs_mod.WIDTH_BUCKETS[-1] + 8)]
    eager = eager_verifier.score([ScoreRequest("a", long_prompt, 1)])[0]
    assert torch.allclose(verifier.score([ScoreRequest("a", long_prompt, 1)])[0], eager, atol=1e-9, rtol=0)
    assert not verifier.stack.graphs.buckets  # no bucket was built for a 40-position call
