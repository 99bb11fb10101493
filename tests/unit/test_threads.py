"""AdaptiveThreads: each pass kind on the thread count measured fastest, following a neighbour that comes and goes."""

from __future__ import annotations

import torch

from s2d_ray.core.threads import AdaptiveThreads, size_bucket


def drive(governor: AdaptiveThreads, costs: list[dict[int, float]], key="k", most: int = 2) -> list[int]:
    """Run one pass per entry of `costs` (seconds per thread count), as the stack does; the counts chosen."""
    chosen = []
    for cost in costs:
        n = governor.choose(key, most)
        governor.record(key, n, cost[n])
        chosen.append(n)
    return chosen


def test_alone_it_keeps_all_threads_and_probes_ever_more_rarely():
    gov = AdaptiveThreads(probe_every=32, max_probe_every=256)
    chosen = drive(gov, [{2: 1.0, 1: 1.6}] * 2000)
    assert chosen[:2] == [2, 1]  # each candidate timed once, the widest first
    probes = [i for i, n in enumerate(chosen) if n == 1][1:]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:4] == [64, 128, 256, 256]  # each confirming probe doubles the interval, up to its cap
    assert len(probes) <= 2000 // 256 + 4  # a fixed interval of 32 would probe 62 times
    assert chosen[-1] == 2


def test_negative_control_a_fixed_interval_probes_at_the_base_rate():
    gov = AdaptiveThreads(probe_every=32, max_probe_every=32)
    chosen = drive(gov, [{2: 1.0, 1: 1.6}] * 2000)
    assert chosen.count(1) >= 2000 // 32 - 1


def test_while_fewer_threads_are_fastest_probes_keep_the_base_rate():
    gov = AdaptiveThreads(probe_every=16, max_probe_every=1024)
    busy, idle = {2: 8.0, 1: 1.7}, {2: 1.0, 1: 1.6}
    chosen = drive(gov, [idle] * 600 + [busy] * 400 + [idle] * 40)
    assert chosen[990:1000].count(1) >= 9  # the neighbour's time runs on one thread
    back = next(i for i in range(1000, 1040) if chosen[i:i + 5] == [2] * 5)
    assert back - 1000 <= 16 + 5  # found within one base interval, however long it ran alone before


def test_a_busy_neighbour_moves_it_to_one_thread_within_a_few_passes_and_back_when_it_leaves():
    gov = AdaptiveThreads(probe_every=16)
    idle, busy = {2: 1.0, 1: 1.6}, {2: 8.0, 1: 1.7}
    chosen = drive(gov, [idle] * 40 + [busy] * 60 + [idle] * 80)
    assert chosen[39] == 2
    assert chosen[45:100].count(1) >= 50
    switched = next(i for i in range(40, 100) if chosen[i:i + 5] == [1] * 5)
    assert switched - 40 <= 5  # the jump triggers a probe at once
    assert chosen[-1] == 2 and chosen[-10:].count(2) >= 9  # periodic probes bring all threads back


def test_negative_control_without_probes_it_never_returns_to_all_threads():
    gov = AdaptiveThreads(probe_every=10**9, jump=float("inf"))
    idle, busy = {2: 1.0, 1: 1.6}, {2: 8.0, 1: 1.7}
    chosen = drive(gov, [idle] * 40 + [busy] * 60 + [idle] * 80)
    assert chosen[-20:] == [1] * 20  # the stale slow times of two threads are never replaced: what probes prevent


def test_each_pass_kind_keeps_its_own_choice():
    gov = AdaptiveThreads()
    drive(gov, [{2: 1.0, 1: 1.5}] * 10, key="narrow")
    drive(gov, [{2: 3.0, 1: 1.0}] * 10, key="wide")
    assert gov.choose("narrow", 2) == 2 and gov.choose("wide", 2) == 1
    assert gov.chosen() == {"threads_2": 1, "threads_1": 1}


def test_run_sets_torch_threads_inside_the_block_and_restores_them():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gov = AdaptiveThreads()
        seen = []
        for _ in range(3):
            with gov.run("k", 2):
                seen.append(torch.get_num_threads())
            assert torch.get_num_threads() == 2
        assert seen[:2] == [2, 1]
        with gov.run("one", 1):  # nothing to choose on one thread
            assert torch.get_num_threads() == 2
        assert "one" not in gov._times
    finally:
        torch.set_num_threads(before)


def test_candidates_and_buckets():
    assert AdaptiveThreads.candidates(16) == [16, 8, 1]
    assert AdaptiveThreads.candidates(2) == [2, 1]
    assert [size_bucket(n) for n in (1, 2, 3, 4, 5, 9, 16, 17)] == [1, 2, 4, 4, 8, 16, 16, 32]
