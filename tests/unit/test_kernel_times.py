"""kernels/timing_store.py: load-time kernel choices decided on the least time each candidate ever took on this
machine, so a process that measures beside busy neighbours keeps a quiet process's choice."""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch

from s2d_ray.kernels import linear
from s2d_ray.kernels.timing_store import ENV_KERNEL_TIMES, TimingStore, least_times, machine_key


@pytest.fixture
def store(tmp_path) -> TimingStore:
    return TimingStore(tmp_path / "kernel_times.json", machine_key())


def test_least_times_keeps_the_minimum_per_candidate_and_key(store):
    assert store.least("k", {"stock": 2.0, "packed": 1.0}) == {"stock": 2.0, "packed": 1.0}
    # A later, noisier measurement cannot raise what a quieter one saw; a faster one lowers it.
    assert store.least("k", {"stock": 1.5, "packed": 3.0}) == {"stock": 1.5, "packed": 1.0}
    assert store.least("other", {"stock": 9.0, "packed": 9.0}) == {"stock": 9.0, "packed": 9.0}
    stored = json.loads(store.path.read_text())
    assert stored[f"{machine_key()} | k"] == {"stock": 1.5, "packed": 1.0} and len(stored) == 2


def test_no_store_and_an_unwritable_file_leave_the_measurement_as_it_is(tmp_path):
    assert least_times(None, "k", {"a": 2.0}) == {"a": 2.0}
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    assert TimingStore(blocked / "times.json", "m").least("k", {"a": 2.0}) == {"a": 2.0}
    torn = tmp_path / "torn.json"
    torn.write_text("{not json")
    assert TimingStore(torn, "m").least("k", {"a": 2.0}) == {"a": 2.0} and json.loads(torn.read_text())  # rewritten


def test_the_setting_names_the_file_and_the_environment_overrides_it(tmp_path, monkeypatch):
    default = tmp_path / "default.json"
    monkeypatch.delenv(ENV_KERNEL_TIMES, raising=False)
    assert TimingStore.from_setting(None, default) == TimingStore(default, machine_key())
    assert TimingStore.from_setting(str(tmp_path / "set.json"), default).path == tmp_path / "set.json"
    assert TimingStore.from_setting("off", default) is None
    monkeypatch.setenv(ENV_KERNEL_TIMES, str(tmp_path / "env.json"))
    assert TimingStore.from_setting(str(tmp_path / "set.json"), default).path == tmp_path / "env.json"
    monkeypatch.setenv(ENV_KERNEL_TIMES, "off")
    assert TimingStore.from_setting(str(tmp_path / "set.json"), default) is None


@pytest.mark.skipif(not linear.supported(torch.float32), reason="oneDNN packing unavailable on this CPU")
def test_stored_quiet_times_decide_the_packed_choice_whatever_this_process_measures(store):
    """packed_is_faster measures here, but decides on the stored minima: times a quiet process stored for the key win
    over any measurement this (possibly loaded) process makes, in either direction."""
    shape, threads = (64, 32), torch.get_num_threads()
    key = f"{machine_key()} | {linear.several_key(*shape, torch.float32, threads)}"
    measure = linear.packed_is_faster.__wrapped__  # past the per-process cache
    store.path.write_text(json.dumps({key: {"stock": 1.0, "packed": 1e-12}}))
    assert measure(*shape, torch.float32, threads, store) is True
    store.path.write_text(json.dumps({key: {"stock": 1e-12, "packed": 1.0}}))
    assert measure(*shape, torch.float32, threads, store) is False
    stored = json.loads(store.path.read_text())[key]
    assert stored["stock"] == 1e-12 and 0 < stored["packed"] < 1.0  # this process's packed time was lower: kept


def _write(store: TimingStore, i: int) -> None:
    for j in range(20):
        store.least(f"p{i}-{j}", {"a": float(i), "b": float(j)})


def test_processes_loading_at_once_lose_no_entry(store):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write, args=(store, i)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    assert len(json.loads(store.path.read_text())) == 80
