"""The slot cache counts passes whose rows were not one in-order range and had to be gathered (each layer then copies
their K/V): what the target's served stats report as `num_gathered_passes`. Rows in ascending order with a few
holes are not gathered: attention reads the covering range's view run by run, with the same logits."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from core_fixtures import random_prompts, tiny_target
from s2d_ray.kernels.attention import CPU_GROUPED
from s2d_ray.kernels.attention import cpu_grouped_attention as grouped_attention  # the CPU's sizes
from s2d_ray.core.cache import MAX_RUNS, SlotKVCache
from s2d_ray.core.target import TargetVerifier
from s2d_ray.core.types import ScoreRequest
from s2d_ray.kernels import CpuKernels


def last_logits(verifier: TargetVerifier, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return verifier.model(torch.tensor([tokens])).logits[0, -1]


def test_rows_apart_attend_run_by_run_and_too_many_runs_are_gathered():
    verifier = TargetVerifier(tiny_target(seed=1), kernels=CpuKernels())  # grouped attention reads runs in place
    prompts = random_prompts(2 * MAX_RUNS + 2, seed=2)
    verifier.score([ScoreRequest(f"s{i}", p, 1) for i, p in enumerate(prompts[:3])])  # rows 0, 1, 2: one range
    assert (verifier.cache.num_passes, verifier.cache.num_gathered) == (1, 0)
    verifier.release("s1")
    out = verifier.score([ScoreRequest(f"s{i}", prompts[i] + [5], 1) for i in (0, 2)])  # rows 0 and 2: two runs
    assert (verifier.cache.num_passes, verifier.cache.num_gathered) == (2, 0)
    for i, o in zip((0, 2), out):  # exact: the hole row's K/V is in the view but never attended
        torch.testing.assert_close(o[0], last_logits(verifier, prompts[i] + [5]), rtol=1e-9, atol=1e-9)
    verifier.score([ScoreRequest("s1", prompts[1], 1)])  # takes the freed row 1
    tokens = {f"s{i}": prompts[i] + [5, 6] for i in range(3)}
    verifier.score([ScoreRequest(s, t, 1) for s, t in tokens.items()])  # rows 0, 1, 2 again: a view
    assert (verifier.cache.num_passes, verifier.cache.num_gathered) == (4, 0)
    # MAX_RUNS + 1 runs (every other row of 2 * MAX_RUNS + 2): gathered, and still exact
    verifier.score([ScoreRequest(f"s{i}", p, 1) for i, p in enumerate(prompts) if i >= 3])
    for i in range(1, len(prompts), 2):
        verifier.release(f"s{i}")
    evens = list(range(0, len(prompts), 2))
    gathered = verifier.cache.num_gathered
    out = verifier.score([ScoreRequest(f"s{i}", (tokens.get(f"s{i}") or prompts[i]) + [7], 1) for i in evens])
    assert verifier.cache.num_gathered == gathered + 1
    for i, o in zip(evens, out):
        torch.testing.assert_close(o[0], last_logits(verifier, (tokens.get(f"s{i}") or prompts[i]) + [7]),
                                   rtol=1e-9, atol=1e-9)


def test_runs_with_length_groups_stay_exact():
    """Rows apart AND attending in length groups (forced by a zero group overhead): the groups map their query rows
    to the covering range's rows; every logit equals the model's own."""
    kernels = CpuKernels(tuning=replace(CPU_GROUPED, group_overhead_slots=0))
    verifier = TargetVerifier(tiny_target(seed=3), kernels=kernels)
    prompts = [p * (1 + 3 * (i % 2)) for i, p in enumerate(random_prompts(5, seed=4))]  # long and short rows
    verifier.score([ScoreRequest(f"s{i}", p, 1) for i, p in enumerate(prompts)])
    verifier.release("s1")
    verifier.release("s3")
    out = verifier.score([ScoreRequest(f"s{i}", prompts[i] + [9, 4], 2) for i in (0, 2, 4)])  # rows 0, 2, 4
    assert verifier.cache.num_gathered == 0
    for i, o in zip((0, 2, 4), out):
        with torch.no_grad():
            ref = verifier.model(torch.tensor([prompts[i] + [9, 4]])).logits[0, -2:]
        torch.testing.assert_close(o, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("rows, runs", [([0, 2], [(0, 1, 0, 1), (1, 2, 2, 3)]), ([3, 4, 6], [(0, 2, 0, 2), (2, 3, 3, 4)]),
                                        ([2, 1], None), ([0, 2, 4, 6, 8], None)])
def test_runs_of_rows(rows, runs):
    assert SlotKVCache._runs(torch.tensor(rows)) == runs


def test_grouped_attention_over_runs_equals_attention_over_gathered_rows():
    """The attention function alone: queries of rows 0, 1, 3 against a covering range of 4 key rows, as runs, equal
    the same queries against the gathered key rows (float64, random, a causal additive mask per row)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 6, 2, 8, generator=g, dtype=torch.float64),
               torch.randn(4, 2, 5, 8, generator=g, dtype=torch.float64),
               torch.randn(4, 2, 5, 8, generator=g, dtype=torch.float64))
    mask = torch.zeros(3, 1, 2, 5, dtype=torch.float64)
    mask[1, ..., 4:] = torch.finfo(torch.float64).min
    keep = torch.tensor([0, 1, 3])
    ref, _ = grouped_attention(None, q, k[keep], v[keep], mask)
    got, _ = grouped_attention(None, q, k, v, mask, kv_runs=[(0, 2, 0, 2), (2, 3, 3, 4)])
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    rows = torch.tensor([0, 2])  # with length groups as well: rows 0 and 2 of the queries
    ref_g, _ = grouped_attention(None, q, k[keep], v[keep], mask, kv_groups=[(rows, 5), (torch.tensor([1]), 4)])
    got_g, _ = grouped_attention(None, q, k, v, mask, kv_groups=[(rows, 5), (torch.tensor([1]), 4)],
                                 kv_runs=[(0, 2, 0, 2), (2, 3, 3, 4)])
    torch.testing.assert_close(got_g, ref_g, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rows, positions, one_run", [
    ([2], [[5, 6, 7]], (2, 5, 8)),  # a chain or prompt: one slice
    ([0], [[9]], (0, 9, 10)),  # a decode step
    ([1], [[3, 5]], None),  # not consecutive: scattered
    ([0, 1], [[4], [4]], None),  # two rows: scattered
])
def test_update_writes_exactly_the_selected_slots(rows, positions, one_run):
    """One row's consecutive slots are copied as a slice, anything else scattered; both write the new K/V at exactly
    the selected slots and leave every other slot as it was."""
    cache = SlotKVCache(1, num_kv_heads=2, head_dim=3, dtype=torch.float64, rows=3, slots=16)
    before = cache.keys[0].clone()
    rows_t, pos_t = torch.tensor(rows), torch.tensor(positions)
    cache.select(rows_t, pos_t, kv_len=int(pos_t.max()) + 1)
    assert cache._slots == one_run
    new = torch.randn(len(rows), 2, len(positions[0]), 3, dtype=torch.float64)  # [n, kv_heads, s, head_dim]
    cache.update(new, -new, 0)
    expected = before.clone()
    for i, r in enumerate(rows):
        for j, p in enumerate(positions[i]):
            expected[r, p] = new[i, :, j]
    torch.testing.assert_close(cache.keys[0], expected, rtol=0, atol=0)
    torch.testing.assert_close(cache.values[0], -expected, rtol=0, atol=0)
