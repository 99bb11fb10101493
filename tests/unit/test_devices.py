"""The engine is exact on every device it picks: greedy S2D == target-only greedy == a no-cache reference.

CPU always runs; CUDA runs where torch sees a GPU (scripts/gpu_check.sh runs this file on a GPU machine) and is
skipped otherwise, so CPU CI is unchanged.
"""

from __future__ import annotations

import pytest
import torch

from core_fixtures import noisy_draft, random_prompts, tiny_target
from s2d_ray.core.cache import head_mask, slot_mask
from s2d_ray.core.draft import SortedDraft, SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.policy import FixedK, HeuristicK
from s2d_ray.core.stack import decoder_parts
from s2d_ray.core.target import TargetVerifier

NO_CUDA = "no CUDA device visible to torch: CUDA exactness runs on a GPU machine (scripts/gpu_check.sh)"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA))]


@pytest.fixture(scope="module", params=DEVICES)
def pair(request):
    """A tiny float64 target and a noisy sorted draft of it, both on the device (built on CPU, then moved)."""
    target = tiny_target(seed=0)
    cpu_draft = noisy_draft(target)
    device = torch.device(request.param)
    target.to(device)
    layers = cpu_draft.layers.to(device)
    return target, SortedDraft(decoder_parts(target), cpu_draft.spec, layers), device


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids], device=model.device)).logits[0, -1].argmax()))
    return ids[len(prompt):]


def generate(engine: SpecEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    return [r.token_ids for r in engine.generate([GenerationRequest(f"s{i}", p, n) for i, p in enumerate(prompts)])]


def test_ar_equals_no_cache_reference(pair):
    target, _, device = pair
    prompts = random_prompts(3, seed=1)
    verifier = TargetVerifier(target)
    assert verifier.stack.device.type == device.type and verifier.cache.keys[0].device.type == device.type
    assert generate(SpecEngine(verifier), prompts, 20) == [reference_greedy(target, p, 20) for p in prompts]


@pytest.mark.parametrize("policy", [FixedK(1), FixedK(4), HeuristicK()], ids=["k1", "k4", "heuristic"])
def test_batched_s2d_equals_target_greedy(pair, policy):
    target, draft, _ = pair
    prompts = random_prompts(5, seed=3, lo=2, hi=30)  # mixed lengths: rows of different widths in one forward
    ar = generate(SpecEngine(TargetVerifier(target)), prompts, 32)
    spec = SpecEngine(TargetVerifier(target), SortedDrafter(draft), policy=policy)
    assert generate(spec, prompts, 32) == ar
    vocab = draft.with_vocab(torch.arange(3, 60))  # a reduced-vocabulary head built from the moved weights
    assert generate(SpecEngine(TargetVerifier(target), SortedDrafter(vocab), policy=policy), prompts, 32) == ar


@pytest.mark.parametrize("device", DEVICES)
def test_head_mask_is_materialised_on_cpu_and_a_view_on_cuda(device):
    positions = torch.tensor([[3, 4], [1, 2]], device=device)
    mask = slot_mask(positions, 5, torch.float32)
    heads = head_mask(mask, 3)
    assert heads.shape == (2, 3, 2, 5) and torch.equal(heads, mask.expand(-1, 3, -1, -1))
    assert (heads.stride(1) == 0) == (device == "cuda")  # CUDA kernels broadcast; CPU SDPA wants one copy per head
