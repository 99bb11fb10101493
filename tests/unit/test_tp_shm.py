"""DeepSpeed's CPU all-reduce buffers of a closed TP group are removed (it never unlinks them: /dev/shm filled up)."""

from __future__ import annotations

import os

from s2d_ray.serve.tp import remove_shm_buffers


def test_only_this_groups_buffers_are_removed(tmp_path):
    uid = os.getuid()
    mine = [tmp_path / f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_41625_{r}" for r in range(3)]
    other_port = tmp_path / f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_41626_0"
    other_user = tmp_path / f"deepspeed_allreduce_buffer_{uid + 1}_127.0.0.1_41625_0"
    unrelated = tmp_path / "something_else_41625_0"
    for f in (*mine, other_port, other_user, unrelated):
        f.write_bytes(b"x")
    assert remove_shm_buffers(41625, str(tmp_path)) == 3
    assert not any(f.exists() for f in mine)
    assert other_port.exists() and other_user.exists() and unrelated.exists()
