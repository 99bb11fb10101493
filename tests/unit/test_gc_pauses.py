"""The collector's pauses counted per process (s2d_ray/gc_pauses.py), as stats() and /stats report them."""

from __future__ import annotations

import gc

import pytest

from s2d_ray.gc_pauses import RECENT, GCPauses, gc_pauses


@pytest.fixture
def recorder():
    pauses = GCPauses()
    gc.callbacks.append(pauses)
    yield pauses
    gc.callbacks.remove(pauses)


def test_pauses_are_counted_per_generation(recorder):
    for gen in (0, 1, 2, 2):
        gc.collect(gen)
    assert recorder.count == [1, 1, 2]
    assert all(s > 0 for s in recorder.seconds) and recorder.longest[2] <= recorder.seconds[2]
    snap = recorder.snapshot()
    assert snap["gen2"]["collections"] == 2 and snap["gen2"]["ms"] >= snap["gen2"]["longest_ms"] > 0
    assert len(snap["gen2"]["recent_ms"]) == 2
    assert max(snap["gen2"]["recent_ms"]) == pytest.approx(snap["gen2"]["longest_ms"], abs=0.1)
    assert gc_pauses() is gc_pauses() and gc_pauses() in gc.callbacks  # one recorder per process


def test_only_the_last_full_collections_are_kept_one_by_one(recorder):
    for _ in range(RECENT + 3):
        gc.collect(2)
    assert recorder.count[2] == RECENT + 3 and len(recorder.snapshot()["gen2"]["recent_ms"]) == RECENT


def test_frozen_counts_what_a_freeze_put_out_of_reach(recorder):
    gc.unfreeze()
    try:
        assert recorder.snapshot()["frozen"] == 0
        kept = [[i] for i in range(1000)]
        gc.freeze()  # what Serve does once a replica's __init__ returns
        assert recorder.snapshot()["frozen"] >= len(kept)
    finally:
        gc.unfreeze()
    assert recorder.snapshot()["frozen"] == 0
