"""core/kernel_times.py: load-time kernel choices decided on the least time each candidate ever took on this machine,
so a process that measures beside busy neighbours keeps a quiet process's choice."""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch

from s2d_ray.core import kernel_times, linear
from s2d_ray.core.kernel_times import least_times, machine_key


@pytest.fixture
def times_file(tmp_path, monkeypatch):
    path = tmp_path / "kernel_times.json"
    monkeypatch.setenv("S2D_KERNEL_TIMES", str(path))
    return path


def test_least_times_keeps_the_minimum_per_candidate_and_key(times_file):
    assert least_times("k", {"stock": 2.0, "packed": 1.0}) == {"stock": 2.0, "packed": 1.0}
    # A later, noisier measurement cannot raise what a quieter one saw; a faster one lowers it.
    assert least_times("k", {"stock": 1.5, "packed": 3.0}) == {"stock": 1.5, "packed": 1.0}
    assert least_times("other", {"stock": 9.0, "packed": 9.0}) == {"stock": 9.0, "packed": 9.0}
    stored = json.loads(times_file.read_text())
    assert stored[f"{machine_key()} | k"] == {"stock": 1.5, "packed": 1.0} and len(stored) == 2


def test_off_and_an_unwritable_file_leave_the_measurement_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setenv("S2D_KERNEL_TIMES", "off")
    assert least_times("k", {"a": 2.0}) == {"a": 2.0} and kernel_times.times_path() is None
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("S2D_KERNEL_TIMES", str(blocked / "times.json"))
    assert least_times("k", {"a": 2.0}) == {"a": 2.0}
    torn = tmp_path / "torn.json"
    torn.write_text("{not json")
    monkeypatch.setenv("S2D_KERNEL_TIMES", str(torn))
    assert least_times("k", {"a": 2.0}) == {"a": 2.0} and json.loads(torn.read_text())  # rewritten whole


@pytest.mark.skipif(not linear.supported(torch.float32), reason="oneDNN packing unavailable on this CPU")
def test_stored_quiet_times_decide_the_packed_choice_whatever_this_process_measures(times_file):
    """packed_is_faster measures here, but decides on the stored minima: times a quiet process stored for the key win
    over any measurement this (possibly loaded) process makes, in either direction."""
    shape, threads = (64, 32), torch.get_num_threads()
    key = f"{machine_key()} | {linear.several_key(*shape, torch.float32, threads)}"
    measure = linear.packed_is_faster.__wrapped__  # past the per-process cache
    times_file.write_text(json.dumps({key: {"stock": 1.0, "packed": 1e-12}}))
    assert measure(*shape, torch.float32, threads) is True
    times_file.write_text(json.dumps({key: {"stock": 1e-12, "packed": 1.0}}))
    assert measure(*shape, torch.float32, threads) is False
    stored = json.loads(times_file.read_text())[key]
    assert stored["stock"] == 1e-12 and 0 < stored["packed"] < 1.0  # this process's packed time was lower: kept


def _write(path: str, i: int) -> None:
    import os

    os.environ["S2D_KERNEL_TIMES"] = path
    for j in range(20):
        least_times(f"p{i}-{j}", {"a": float(i), "b": float(j)})


def test_processes_loading_at_once_lose_no_entry(times_file):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write, args=(str(times_file), i)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    assert len(json.loads(times_file.read_text())) == 80
