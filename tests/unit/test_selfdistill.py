"""Multi-target self-distillation data: chunked, compressed, resumable after kill -9, deterministic (tiny models)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import save_tiny_llama
from s2d_ray.train.data import data_hash, load_examples, read_rows
from s2d_ray.train.selfdistill import Responder, generate_chunks, pick_rows


def instruction_file(path: Path, n: int = 14) -> Path:
    rows = [{"id": f"r{i}", "source": "gsm8k_train" if i % 3 == 0 else "synthetic",
             "instruction": f"Count from {i} please.", "response": "one two"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def two_targets(tmp_path, tiny_llama_dir):
    return [str(tiny_llama_dir), str(save_tiny_llama(tmp_path / "other", seed=1))]


def run_chunks(targets, rows, out, stop_after=None):
    return generate_chunks(targets, rows, out, {"seed": 0}, max_new_tokens=5, batch=3, stop_after=stop_after)


def test_chunks_cover_every_row_once_round_robin_over_the_targets(tmp_path, two_targets):
    rows = pick_rows(instruction_file(tmp_path / "i.jsonl"), None, 0, "train")
    info = run_chunks(two_targets, rows, tmp_path / "sd")
    chunks = sorted((tmp_path / "sd").glob("chunk-*.jsonl.gz"))
    assert info["chunks_done"] == info["chunks_total"] == len(chunks) == -(-len(rows) // 3)
    got = list(read_rows(tmp_path / "sd"))
    assert [r["id"] for r in got] == [r["id"] for r in rows]
    assert [r["target"] for r in got] == [two_targets[(i // 3) % 2] for i in range(len(rows))]
    # Each row is exactly that target's greedy continuation of the prompt.
    for target in two_targets:
        mine = [r for r in got if r["target"] == target]
        again = Responder(target, max_new_tokens=5).respond([next(x for x in rows if x["id"] == r["id"])
                                                             for r in mine])
        assert [r["response_ids"] for r in again] == [r["response_ids"] for r in mine]
    # The directory is training data: assistant tokens only carry loss.
    from s2d_ray.models import load_model

    examples = load_examples([tmp_path / "sd"], load_model(two_targets[0]).tokenizer, "train")
    assert sum(sum(m) for _, m in examples) == sum(len(r["response_ids"]) for r in got)


def test_interrupted_run_resumes_to_the_same_bytes(tmp_path, two_targets):
    rows = pick_rows(instruction_file(tmp_path / "i.jsonl"), None, 0, "train")
    run_chunks(two_targets, rows, tmp_path / "straight")
    first = run_chunks(two_targets, rows, tmp_path / "resumed", stop_after=2)
    assert first["chunks_done"] == 2
    # kill -9 during a write leaves only a temporary file; it is redone, never read.
    (tmp_path / "resumed" / "chunk-000002.jsonl.gz.tmp").write_bytes(b"\x1f\x8b half a chunk")
    second = run_chunks(two_targets, rows, tmp_path / "resumed")
    assert second["chunks_done"] == second["chunks_total"]
    assert data_hash([tmp_path / "resumed"]) == data_hash([tmp_path / "straight"])
    again = run_chunks(two_targets, rows, tmp_path / "resumed")  # nothing left: no work, no change
    assert again["generated_tokens"] == 0


def test_other_settings_in_the_same_directory_are_refused(tmp_path, two_targets):
    rows = pick_rows(instruction_file(tmp_path / "i.jsonl"), None, 0, "train")
    run_chunks(two_targets, rows, tmp_path / "sd", stop_after=1)
    with pytest.raises(ValueError, match="other settings"):
        run_chunks(two_targets[::-1], rows, tmp_path / "sd")


def test_cli_needs_a_directory_for_several_targets(tmp_path, two_targets, capsys):
    from s2d_ray.cli import main

    data = instruction_file(tmp_path / "i.jsonl")
    assert main(["self-distill", "--target", *two_targets, "--data", str(data), "--out",
                 str(tmp_path / "x.jsonl")]) != 0
    assert "directory" in capsys.readouterr().err
    assert main(["self-distill", "--target", *two_targets, "--data", str(data), "--out", str(tmp_path / "sd"),
                 "--max-new-tokens", "3", "--batch-size", "4", "--stop-after", "1"]) == 0
    assert len(list((tmp_path / "sd").glob("chunk-*.jsonl.gz"))) == 1


def test_shards_write_disjoint_chunks_that_together_equal_one_run(tmp_path, two_targets):
    """`--shard I/N`: N processes on one directory (a GPU run) never write the same chunk, and together they make
    the same bytes as one process."""
    rows = pick_rows(instruction_file(tmp_path / "i.jsonl"), None, 0, "train")
    run_chunks(two_targets, rows, tmp_path / "one")
    seen = []
    for i in range(3):
        before = set((tmp_path / "sharded").glob("chunk-*.jsonl.gz"))
        generate_chunks(two_targets, rows, tmp_path / "sharded", {"seed": 0}, max_new_tokens=5, batch=3,
                        shard=(i, 3))
        new = set((tmp_path / "sharded").glob("chunk-*.jsonl.gz")) - before
        assert all(int(p.name[6:12]) % 3 == i for p in new)
        seen += new
    assert len(seen) == len(set(seen)) == -(-len(rows) // 3)
    assert data_hash([tmp_path / "sharded"]) == data_hash([tmp_path / "one"])


def test_a_bad_shard_is_one_clear_error():
    from s2d_ray.errors import ConfigError
    from s2d_ray.train.cli import parse_shard

    assert parse_shard("1/4") == (1, 4) and parse_shard(None) is None
    for bad in ("4/4", "x/2", "1"):
        with pytest.raises(ConfigError, match="--shard"):
            parse_shard(bad)
