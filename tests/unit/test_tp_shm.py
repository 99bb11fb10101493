"""DeepSpeed's CPU all-reduce buffers (it never unlinks them: /dev/shm filled up): a rank unlinks its own name once
every rank passed the barrier, a rank without one never waits there, and a closed group's leftovers are removed.
tests/serve/test_serve_lifecycle.py checks a live TP group answers with no file left."""

from __future__ import annotations

import os

from s2d_ray.shm_buffers import remove_shm_buffers, unlink_when_mapped


def _files(tmp_path, port, ranks, uid=None):
    uid = os.getuid() if uid is None else uid
    files = [tmp_path / f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_{port}_{r}" for r in ranks]
    for f in files:
        f.write_bytes(b"x")
    return files


def test_only_this_groups_buffers_are_removed(tmp_path):
    mine = _files(tmp_path, 41625, range(3))
    other_port, other_user = _files(tmp_path, 41626, [0]) + _files(tmp_path, 41625, [0], uid=os.getuid() + 1)
    unrelated = tmp_path / "something_else_41625_0"
    unrelated.write_bytes(b"x")
    assert remove_shm_buffers(41625, str(tmp_path)) == 3
    assert not any(f.exists() for f in mine)
    assert other_port.exists() and other_user.exists() and unrelated.exists()


def test_a_rank_unlinks_its_own_buffer_after_the_barrier(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "41625")
    rank0, rank1 = _files(tmp_path, 41625, [0, 1])
    seen = []
    assert unlink_when_mapped(1, lambda: seen.append(rank1.exists()), str(tmp_path)) == 1
    assert seen == [True]  # the name stayed until every rank had mapped it
    assert not rank1.exists() and rank0.exists()  # rank 0's is rank 0's to unlink


def test_no_buffer_no_barrier(tmp_path, monkeypatch):
    """On GPUs DeepSpeed makes no buffer on any rank: waiting at a barrier only some ranks reach would hang."""
    monkeypatch.setenv("MASTER_PORT", "41625")
    _files(tmp_path, 41626, [0])
    assert unlink_when_mapped(0, lambda: (_ for _ in ()).throw(AssertionError("barrier")), str(tmp_path)) == 0
