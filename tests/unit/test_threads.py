"""AdaptiveThreads: each pass kind on the thread count measured fastest, following a neighbour that comes and goes."""

from __future__ import annotations

import pytest
import torch

from s2d_ray.kernels.threads import AdaptiveThreads, size_bucket


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


def test_one_probe_brings_all_threads_back_after_a_long_busy_spell():
    """The slow times two threads took beside the neighbour fill their window; a probe that beats one thread is
    repeated on the next pass, and the two fast times switch back at once (one fast time against two stale slow ones
    would leave the pass on one thread for another whole interval)."""
    gov = AdaptiveThreads(probe_every=16)
    idle, busy = {2: 1.0, 1: 1.6}, {2: 8.0, 1: 1.7}
    chosen = drive(gov, [idle] * 40 + [busy] * 400 + [idle] * 60)
    assert chosen[420:440].count(1) >= 18
    first = next(i for i in range(440, 480) if chosen[i] == 2)  # the first probe after the neighbour left
    assert first - 440 <= 16
    assert chosen[first:first + 16] == [2] * 16  # then only the re-times of one thread, every interval


def test_a_fast_probe_beside_the_neighbour_costs_one_pass():
    """A probe that happens to run fast while the neighbour is still there (it slept through it) costs one more
    re-time, which runs slow, and the pass stays on one thread."""
    gov = AdaptiveThreads(probe_every=16)
    busy = {2: 8.0, 1: 1.7}
    chosen, lucky = [], None
    for i in range(140):
        n = gov.choose("k", 2)
        fast = lucky is None and i >= 60 and n == 2
        lucky = i if fast else lucky
        gov.record("k", n, 0.9 if fast else busy[n])
        chosen.append(n)
    assert chosen[lucky + 1] == 2  # the lucky probe is repeated
    assert chosen[lucky + 2:lucky + 16] == [1] * 14  # which ran slow: one thread stays


@pytest.mark.parametrize("idle_cores", [None, 1.0, 0.0])
def test_cores_coming_back_for_one_kind_re_time_every_kind_on_fewer_threads(idle_cores):
    """A rarely run kind (a big batch, a long tree) re-times on its next pass once a frequent kind finds all threads
    fastest again, not after an interval of its own passes; unless the idle cores say the neighbour is still there
    (the frequent kind's passes were lucky), when the rare kind keeps its own rate."""
    source = None if idle_cores is None else Idle()
    gov = AdaptiveThreads(probe_every=16, idle=source)
    idle, busy = {2: 1.0, 1: 1.6}, {2: 8.0, 1: 1.7}

    def step(i: int, cost: dict[int, float]) -> tuple[int, int | None]:
        a = gov.choose("a", 2)
        gov.record("a", a, cost[a])
        if i % 7:
            return a, None
        b = gov.choose("b", 2)
        gov.record("b", b, cost[b])
        return a, b

    for i in range(300):
        step(i, busy)
    assert gov.choose("b", 2) == 1 and gov.choose("a", 2) == 1
    gov._calls.clear()  # those two looks were not passes
    if source is not None:
        source.cores = idle_cores
    rows = [step(i, idle) for i in range(300, 360)]
    back = next(i for i, (a, _) in enumerate(rows) if a == 2)
    b_after = [b for _, b in rows[back + 1:] if b is not None]
    if idle_cores == 0.0:
        assert b_after[0] == 1  # not sent to re-time
    else:
        assert b_after[:3] == [2, 2, 2]  # b's first pass after a came back probes two threads, and keeps them


class Idle:
    """A settable idle-core count, as hardware.IdleCores reports it."""

    def __init__(self) -> None:
        self.cores = 0.0

    def __call__(self) -> float:
        return self.cores


def test_idle_cores_bring_all_threads_back_within_a_few_passes():
    idle_source = Idle()
    gov = AdaptiveThreads(probe_every=32, idle=idle_source)
    plain = AdaptiveThreads(probe_every=32)  # negative control: no idle cue
    idle, busy = {2: 1.0, 1: 1.6}, {2: 8.0, 1: 1.7}
    for g in (gov, plain):
        drive(g, [idle] * 40 + [busy] * 200)
    assert gov.choose("k", 2) == plain.choose("k", 2) == 1
    idle_source.cores = 1.0  # the neighbour left: one core idle while the pass runs on the other
    cued, uncued = drive(gov, [idle] * 40), drive(plain, [idle] * 40)
    assert cued[6:].count(1) <= 1  # re-timed within idle_every passes, repeated once, then kept (bar one re-time)
    assert uncued[:8] == [1] * 8


def test_idle_cores_that_mislead_fall_back_to_the_base_rate():
    """Idle cores reported while the neighbour is still there (a container's view of the host): each cued re-time
    loses, the cue's spacing doubles up to the base interval, so it costs a few slow passes, not one in four."""
    idle_source = Idle()
    idle_source.cores = 2.0
    gov = AdaptiveThreads(probe_every=32, idle=idle_source)
    plain = AdaptiveThreads(probe_every=32)
    busy = {2: 8.0, 1: 1.7}
    cued, uncued = drive(gov, [busy] * 600), drive(plain, [busy] * 600)
    assert cued[-20:].count(1) >= 19
    assert cued.count(2) <= uncued.count(2) + 6
