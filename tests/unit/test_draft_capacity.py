"""The draft's adaptive batching window and capacity stats: no waiting for one target, a share of a forward for
several, busy fraction and queueing delay from recorded forwards."""

from __future__ import annotations

import pytest

from s2d_ray.serve.draft_capacity import DraftCapacity
from s2d_ray.serve.metrics import ServeMetrics


def test_one_target_never_waits():
    cap = DraftCapacity(max_wait_s=0.05, wait_fraction=0.5)
    cap.forward([0.0], {"a"}, 4, 0.0, 0.02)
    for i in range(10):
        assert cap.arrive("a", 1.0 + 0.03 * i) == 0.0  # busy round after round, but no one else to wait for


def test_other_active_target_waits_a_share_of_a_forward_up_to_the_cap():
    cap = DraftCapacity(max_wait_s=0.05, wait_fraction=0.5)
    cap.forward([0.0], {"a"}, 4, 0.0, 0.02)
    for i in range(5):  # b rounds every 30 ms
        cap.arrive("b", 1.0 + 0.03 * i)
    assert cap.arrive("a", 1.13) == pytest.approx(0.01)  # b is due: half a 20 ms forward
    assert cap.arrive("a", 5.0) == 0.0  # b went quiet long ago: nothing is expected
    slow = DraftCapacity(max_wait_s=0.005, wait_fraction=0.5)
    slow.forward([0.0], {"a"}, 4, 0.0, 0.2)
    slow.arrive("b", 1.0)
    slow.arrive("b", 1.1)
    assert slow.arrive("a", 1.15) == 0.005  # capped


def test_stats_count_merges_busy_fraction_and_queueing():
    cap = DraftCapacity(max_wait_s=0.05)
    t0 = cap.started
    cap.num_calls = 3
    cap.forward([t0, t0 + 0.001], {"a", "b"}, 6, t0 + 0.002, t0 + 0.012)
    cap.forward([t0 + 0.02], {"a"}, 2, t0 + 0.02, t0 + 0.03)
    s = cap.stats()
    assert (s["num_forwards"], s["num_merged_forwards"], s["num_rows"], s["rows_per_forward"]) == (2, 1, 8, 4.0)
    assert s["num_merged_rows"] == 6  # the 2-target forward's rows; the lone target's 2 rows are not shared
    assert s["queue_delay_s"] == pytest.approx(0.003)
    assert s["mean_queue_delay_s"] == pytest.approx(0.001)
    assert s["busy_s"] == pytest.approx(0.02)
    assert cap.busy_fraction(t0 + 0.04) == pytest.approx(0.5)
    assert cap.busy_fraction(t0 + 100.0) == 0.0  # forwards older than the window no longer count


def test_prometheus_exports_the_draft_stats():
    m = ServeMetrics()
    m.record_draft({"num_calls": 7, "num_forwards": 5, "num_merged_forwards": 3, "busy_fraction": 0.25})
    m.record_draft({"error": "TimeoutError: "})  # an unreachable draft leaves the last values
    text = m.render().decode()
    assert "s2d:draft_num_merged_forwards 3.0" in text
    assert "s2d:draft_busy_fraction 0.25" in text
