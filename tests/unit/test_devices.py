"""The engine is exact on every device it picks: greedy S2D == target-only greedy == a no-cache reference.

CPU always runs; CUDA runs where torch sees a GPU (scripts/gpu_check.sh runs this file on a GPU machine) and is
skipped otherwise, so CPU CI is unchanged.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from core_fixtures import noisy_draft, random_prompts, tiny_target
from s2d_ray.core.budget import SpeculationBudget, TreeShape
from s2d_ray.core.cache import head_mask, slot_mask
from s2d_ray.core.draft import SortedDraft, SortedDrafter
from s2d_ray.core.engine import GenerationRequest, SpecEngine
from s2d_ray.core.kernels import STOCK
from s2d_ray.core.lookup import PromptLookup, TreeDrafter
from s2d_ray.core.policy import FixedK, HeuristicK
from s2d_ray.core.decoder import decoder_parts
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.types import SamplingParams
from s2d_ray.kernels import CpuKernels
from s2d_ray.kernels.attention import CPU_GROUPED

NO_CUDA = "no CUDA device visible to torch: CUDA exactness runs on a GPU machine (scripts/gpu_check.sh)"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA))]


# "cpu": the CPU backend the engine is built with (grouped attention, packed projections where measured faster).
# "cpu-sdpa": the stock kernels on the CPU, i.e. the CUDA code path (the model's SDPA with per-head mask views), so
# CPU CI covers it: a KV cache passed under a keyword the layers ignore would otherwise show only on a GPU.
# "cpu-groups": grouped attention with every row length its own attention group (plan_kv_groups at zero overhead) and
# prompt passes in blocks of 4 queries, where the real settings never split these short contexts.
ENGINE_DEVICES = ["cpu", "cpu-sdpa", "cpu-groups", *DEVICES[1:]]


@pytest.fixture(scope="module", params=ENGINE_DEVICES)
def pair(request):
    """A tiny float64 target and a noisy sorted draft of it, both on the device (built on CPU, then moved); the
    draft carries the kernels its engine runs with (`draft.kernels`, given to every verifier of the test too)."""
    if request.param == "cpu-groups":  # and prompt passes in blocks of 4 queries
        kernels = CpuKernels(tuning=replace(CPU_GROUPED, group_overhead_slots=0, query_block=4))
    else:
        kernels = STOCK if request.param == "cpu-sdpa" else CpuKernels()
    target = tiny_target(seed=0)
    cpu_draft = noisy_draft(target)
    device = torch.device(request.param.split("-")[0])
    target.to(device)
    layers = cpu_draft.layers.to(device)
    yield target, SortedDraft(decoder_parts(target), cpu_draft.spec, layers, kernels=kernels), device


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids], device=model.device)).logits[0, -1].argmax()))
    return ids[len(prompt):]


def generate(engine: SpecEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    return [r.token_ids for r in engine.generate([GenerationRequest(f"s{i}", p, n) for i, p in enumerate(prompts)])]


def test_ar_equals_no_cache_reference(pair):
    target, draft, device = pair
    prompts = random_prompts(3, seed=1)
    verifier = TargetVerifier(target, kernels=draft.kernels)
    assert verifier.stack.device.type == device.type and verifier.cache.keys[0].device.type == device.type
    assert verifier.stack.grouped == (device.type == "cpu" and draft.kernels is not STOCK)
    assert generate(SpecEngine(verifier), prompts, 20) == [reference_greedy(target, p, 20) for p in prompts]


@pytest.mark.parametrize("policy", [FixedK(1), FixedK(4), HeuristicK()], ids=["k1", "k4", "heuristic"])
def test_batched_s2d_equals_target_greedy(pair, policy):
    target, draft, _ = pair
    prompts = random_prompts(5, seed=3, lo=2, hi=30)  # mixed lengths: rows of different widths in one forward
    ar = generate(SpecEngine(TargetVerifier(target, kernels=draft.kernels)), prompts, 32)
    spec = SpecEngine(TargetVerifier(target, kernels=draft.kernels), SortedDrafter(draft), policy=policy)
    assert generate(spec, prompts, 32) == ar
    vocab = draft.with_vocab(torch.arange(3, 60))  # a reduced-vocabulary head built from the moved weights
    spec = SpecEngine(TargetVerifier(target, kernels=draft.kernels), SortedDrafter(vocab), policy=policy)
    assert generate(spec, prompts, 32) == ar


@pytest.mark.parametrize("device", DEVICES)
def test_head_mask_is_materialised_on_cpu_and_a_view_on_cuda(device):
    positions = torch.tensor([[3, 4], [1, 2]], device=device)
    mask = slot_mask(positions, 5, torch.float32)
    heads = head_mask(mask, 3)
    assert heads.shape == (2, 3, 2, 5) and torch.equal(heads, mask.expand(-1, 3, -1, -1))
    assert (heads.stride(1) == 0) == (device == "cuda")  # CUDA kernels broadcast; CPU SDPA wants one copy per head


def tree_engine(target, draft: SortedDraft, width: int, frontier: int = 0, prefill_chunk: int = 256) -> SpecEngine:
    """The shipped proposal shape (a draft tree plus prompt-lookup candidates), optionally with frontier expansion."""
    drafter = TreeDrafter(SortedDrafter(draft, prefill_chunk=prefill_chunk), PromptLookup(max_ngram=3, num_tokens=6),
                          alone_ngram=3)
    shape = TreeShape(width=width, lookup=True, max_nodes=16, frontier=frontier)
    return SpecEngine(TargetVerifier(target, prefill_chunk=prefill_chunk, kernels=draft.kernels), drafter, FixedK(4),
                      budget=SpeculationBudget(shape, None, max_depth=6))


def repetitive(prompts: list[list[int]]) -> list[list[int]]:
    return [p + p + p[:2] for p in prompts]  # lookup finds matches, as in code or math text


@pytest.mark.parametrize("width,frontier", [(3, 0), (3, 3)], ids=["tree+lookup", "frontier"])
def test_trees_with_lookup_equal_target_greedy(pair, width, frontier):
    """Tree attention masks, accepted-path KV compaction and lookup nodes on the device: output == target greedy."""
    target, draft, _ = pair
    prompts = random_prompts(3, seed=5) + repetitive(random_prompts(2, seed=6, lo=4, hi=9))
    ar = generate(SpecEngine(TargetVerifier(target, kernels=draft.kernels)), prompts, 40)
    engine = tree_engine(target, draft, width, frontier)
    out = engine.generate([GenerationRequest(f"s{i}", p, 40) for i, p in enumerate(prompts)])
    assert [o.token_ids for o in out] == ar
    assert sum(o.metrics["num_accepted_draft_tokens"] for o in out) > 0


def test_chunked_prefill_trees_equal_target_greedy(pair):
    """Prompts longer than the prefill chunk run in passes on the device (draft and target) and stay exact."""
    target, draft, _ = pair
    prompts = [p * 6 for p in random_prompts(3, seed=8, lo=8, hi=14)]  # 48-84 tokens, chunks of 16
    ar = generate(SpecEngine(TargetVerifier(target, prefill_chunk=0, kernels=draft.kernels)), prompts, 24)
    assert generate(tree_engine(target, draft, 2, prefill_chunk=16), prompts, 24) == ar


def test_tree_sampling_follows_target_distribution(pair):
    """Sampling through draft tree + lookup + batched verification on the device: output tokens 2-3 (the first
    drafting round's, k = 2) ~ the target's joint distribution (total variation < 0.06 over 6000 draws, vocabulary
    8). CPU runs it in test_trees.py."""
    from test_sampling import exact_second_and_third, pair_histogram, tv

    device = pair[2]
    if device.type == "cpu":
        pytest.skip("the CPU twin of this check is test_trees.py::test_engine_tree_sampling_follows_target_distribution")
    target = tiny_target(seed=5, vocab_size=8, scale=1.5)
    cpu_draft = noisy_draft(target, noise=0.3, thresholds=[0.3, 0.3, 0.0])
    prompt, params = [3, 5, 3, 5, 3], SamplingParams(temperature=1.0)  # lookup proposes [5, 3, ...]
    exact = exact_second_and_third(target, prompt, params)  # on the CPU, before the move
    target.to(device)
    draft = SortedDraft(decoder_parts(target), cpu_draft.spec, cpu_draft.layers.to(device), kernels=CpuKernels())
    err = tv(pair_histogram(tree_engine(target, draft, 3), 8, prompt, params, 6000)[0], exact)
    assert err < 0.06, err
