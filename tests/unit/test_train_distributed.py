"""Multi-worker training and self-distillation on a real local Ray cluster (gloo, 2 workers, tiny float64 models).

One Ray cluster and one one-process reference run serve the whole module: Ray Train's workers take seconds to start
on a small machine, so every multi-worker run here is made to check several things at once.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers import make_tiny_tokenizer, save_tiny_llama
from s2d_ray.errors import ConfigError
from s2d_ray.shm_buffers import buffer_paths
from s2d_ray.train.cluster import WorkerSpec
from s2d_ray.train.data import check_token_rows
from s2d_ray.train.distributed import slice_rows
from s2d_ray.train.ray_train import ParallelTraining, train_on_ray
from s2d_ray.train.soft import CKPT, Run, SoftConfig, check_same_run

STEPS = 6


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster (or the one this test run already has); yields a worker count it cannot hold."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=128 * 2**20,
                 log_to_driver=False)
    yield int(ray.cluster_resources()["CPU"]) + 1
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny float64 target, instruction data, and the config every run here shares (KD from a cached target,
    a reduced vocabulary, the norm and head rows trained: every tensor a worker shares)."""
    root = tmp_path_factory.mktemp("dist")
    model = save_tiny_llama(root / "model", dtype=torch.float64)
    rows = [{"id": f"r{i}", "instruction": f"Count from {i} please." + " more" * (i % 5),
             "response": " ".join(["one two three four"] * (1 + i % 4))} for i in range(80)]
    data = root / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = SoftConfig(target=str(model), out=str(root / "one"), data=[str(data)], num_layers=2, exit_layers=[1, 2],
                     seq_len=64, batch_size=4, steps=STEPS, lr=1e-2, warmup=0.1, val_every=2, ckpt_every=2,
                     val_examples=4, seed=0, dtype="float64", device="cpu", vocab_size=64, train_norm_head=True,
                     kd_targets=[str(model)], kd_weight=0.5, kd_temperature=2.0, kd_cache=str(root / "kd-one"),
                     kd_topk=8, threads=1)
    return root, cfg


@pytest.fixture(scope="module")
def straight(base):
    """The one-process run: its checkpoint after step 2 (kept aside), its curve and final weights."""
    root, cfg = base
    run = Run(cfg)
    run.train(progress=False, until=2)
    shutil.copy(Path(cfg.out) / CKPT, root / "step2.pt")
    run.train(progress=False)
    return run


def losses(history: list[dict], upto: int) -> list[float]:
    return [v for h in history if h["train_loss"] and h["step"] <= upto for v in h["train_loss"]]


def assert_same_weights(a: dict, b: dict, rtol: float, atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_same_weights(a[key], b[key], rtol, atol)
        else:
            torch.testing.assert_close(a[key], b[key], rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")


def finish_in_one_process(cfg: SoftConfig) -> Run:
    """Continue a multi-worker run's checkpoint in one process to the end (the checkpoint is interchangeable)."""
    run = Run(cfg)
    assert run.resume()
    run.train(progress=False)
    return run


def test_global_batch_shares_give_the_one_process_gradient(base, straight):
    """Each rank's loss scaled by its share of the global counts: the mean of the ranks' gradients is the gradient
    of the global batch. Negative control: plain per-rank means (shares 1, 1) give another gradient here, because
    the two halves of a batch hold different numbers of labelled tokens."""
    _, cfg = base
    run = Run(replace(cfg, out=str(Path(cfg.out).parent / "shares")))
    batch = run.batch_at(0)
    halves = [slice_rows(batch, 0, 2), slice_rows(batch, 2, 4)]
    counts = [int((h.labels != -100).sum()) for h in halves]
    assert counts[0] != counts[1]

    def grads(parts: list, shares: list[tuple[float, float]]) -> list[torch.Tensor]:
        total = [torch.zeros_like(p) for p in run.params]
        for part, share in zip(parts, shares):
            run.opt.zero_grad(set_to_none=True)
            run.loss_on(part, share)[0].backward()
            total = [t + p.grad / len(parts) for t, p in zip(total, run.params)]
        return total

    whole = grads([batch], [(1.0, 1.0)])
    ce = [int((run.vocab.map_labels(h.labels[h.labels != -100]) != -100).sum()) for h in halves]
    shared = grads(halves, [(2 * c / sum(ce), 2 * n / sum(counts)) for c, n in zip(ce, counts)])
    plain = grads(halves, [(1.0, 1.0), (1.0, 1.0)])
    for w, s in zip(whole, shared):
        torch.testing.assert_close(s, w, rtol=1e-6, atol=1e-9)
    assert max(float((p - w).abs().max()) for p, w in zip(plain, whole)) > 1e-4


def test_ddp_two_workers_equal_one_process_and_resume_after_a_killed_worker(base, straight, ray_cluster):
    """2 DDP workers, rank 1 killed once before step 3, restarted from Ray Train's step-2 checkpoint; stopped at
    step 4 and finished in one process: the curve and the final weights are the one-process run's."""
    root, cfg = base
    marker = root / "killed"

    def kill_once(rank: int, step: int) -> None:
        with open(root / f"steps-rank{rank}", "a") as fh:
            fh.write(f"{step}\n")
        if rank == 1 and step == 3 and not marker.exists():
            marker.write_text("x")
            os._exit(1)

    two = replace(cfg, out=str(root / "ddp"), kd_cache=str(root / "kd-ddp"))
    plan = ParallelTraining(workers=WorkerSpec(num_workers=2), zero=0, max_failures=1, stop_at=4, progress=False,
                            step_hook=kill_once)
    result = train_on_ray(two, plan)
    assert result["steps"] == 4
    ran = (root / "steps-rank1").read_text().split()
    assert marker.exists() and ran.count("2") == 2, ran  # it died and redid the steps after the step-2 checkpoint
    ck = torch.load(Path(two.out) / CKPT, weights_only=False)
    assert ck["step"] == 4
    want, got = losses(straight.history, 4), losses(ck["history"], 4)
    assert len(got) == len(want) == 4
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    # The KD cache the two workers built together holds what the one-process run built alone.
    shared = [(part, Path(two.kd_cache) / part.relative_to(cfg.kd_cache))
              for part in sorted(Path(cfg.kd_cache).rglob("part-*.pt"))]
    shared = [(a, b) for a, b in shared if b.exists()]
    assert len(shared) >= 4
    for a, b in shared:
        assert torch.equal(torch.load(a)["values"], torch.load(b)["values"])
    finished = finish_in_one_process(two)
    assert_same_weights(finished.trainable_state(), straight.trainable_state(), rtol=1e-6, atol=1e-8)


def test_zero2_resumes_a_one_process_checkpoint_and_hands_back_its_own(base, straight, ray_cluster):
    """ZeRO-2 on 2 workers from the one-process step-2 checkpoint (its AdamW state scattered into the partitions),
    stopped at step 4 (the partitions gathered into one-process form), finished in one process: the DDP result
    within the rounding of ZeRO's float32 master weights."""
    root, cfg = base
    two = replace(cfg, out=str(root / "zero2"), kd_cache=str(root / "kd-zero2"))
    Path(two.out).mkdir()
    shutil.copy(root / "step2.pt", Path(two.out) / CKPT)
    plan = ParallelTraining(workers=WorkerSpec(num_workers=2), zero=2, resume=True, stop_at=4, progress=False,
                            max_failures=0)
    left = set(buffer_paths("*"))
    assert train_on_ray(two, plan)["steps"] == 4
    assert set(buffer_paths("*")) <= left  # DeepSpeed's /dev/shm buffers went with the workers
    ck = torch.load(Path(two.out) / CKPT, weights_only=False)
    assert set(ck["opt"]["state"]) == set(range(len(straight.params)))
    torch.testing.assert_close(torch.tensor(losses(ck["history"], 4)), torch.tensor(losses(straight.history, 4)),
                               rtol=1e-5, atol=0)
    finished = finish_in_one_process(two)
    assert_same_weights(finished.trainable_state(), straight.trainable_state(), rtol=1e-4, atol=1e-6)


def test_refused_before_any_work(base, ray_cluster, tmp_path):
    _, cfg = base
    out, n = replace(cfg, out=str(tmp_path / "never")), ray_cluster
    with pytest.raises(ConfigError, match=rf"--num-workers {n} needs {n} CPUs \(1 per worker\) but the Ray cluster "
                                          rf"has {n - 1}; lower --num-workers"):
        train_on_ray(out, ParallelTraining(workers=WorkerSpec(num_workers=n)))
    with pytest.raises(ValueError, match="--zero 3 is not supported"):
        train_on_ray(out, ParallelTraining(workers=WorkerSpec(num_workers=2), zero=3))
    assert not Path(out.out).exists()


def test_cli_names_the_bad_worker_count_in_one_line(base, ray_cluster, tmp_path, capsys):
    from s2d_ray.cli import main

    _, cfg = base
    n = ray_cluster
    code = main(["train-draft", "--target", cfg.target, "--data", *cfg.data, "--out", str(tmp_path / "r"),
                 "--num-workers", str(n), "--batch-size", str(n), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and f"--num-workers {n} needs {n} CPUs" in err


def test_resume_with_other_settings_names_them(base):
    _, cfg = base
    with pytest.raises(ValueError, match=r"lr \(0.01 there, 0.02 now\)"):
        check_same_run(json.loads(json.dumps(cfg.__dict__)), replace(cfg, lr=0.02), Path("ck"))
    check_same_run(json.loads(json.dumps(cfg.__dict__)), replace(cfg, steps=99, threads=2), Path("ck"))


def test_data_of_another_tokenizer_is_refused(tmp_path):
    """Self-distilled rows store ids: rows whose prompt this tokenizer would encode differently (another tokenizer's
    ids: here the same vocabulary in reverse order), or with ids beyond it, are refused; its own rows pass."""
    tok = make_tiny_tokenizer()
    prompt = [{"role": "user", "content": "Count from 7 please, then add the numbers together."}]
    ids = list(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False))

    def rows(prompt_ids: list[int], response_ids: list[int]) -> Path:
        path = tmp_path / f"sd{len(list(tmp_path.iterdir()))}.jsonl"
        path.write_text(json.dumps({"id": "a", "target": "t", "prompt_ids": prompt_ids, "response_ids": response_ids}))
        return path

    check_token_rows([rows(ids, [5, 6])], tok, "tiny")  # control: this tokenizer's rows pass
    for bad in (rows([len(tok) - 1 - i for i in ids], [5, 6]), rows(ids, [5, len(tok)])):
        with pytest.raises(ConfigError, match="--data .* tokenised with another tokenizer than --target tiny"):
            check_token_rows([bad], tok, "tiny")


def test_self_distill_on_two_actors_writes_the_same_bytes(tmp_path, ray_cluster):
    from s2d_ray.train.pool import ChunkPool
    from s2d_ray.train.selfdistill import generate_chunks, pick_rows

    targets = [str(save_tiny_llama(tmp_path / "a")), str(save_tiny_llama(tmp_path / "b", seed=1))]
    data = tmp_path / "i.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "instruction": f"Count from {i} please."}) + "\n"
                            for i in range(14)))
    rows = pick_rows(data, None, 0, "train")

    def chunks(out: Path, pool=None) -> dict[str, bytes]:
        info = generate_chunks(targets, rows, out, {"seed": 0}, max_new_tokens=5, batch=3, threads=1, pool=pool)
        assert info["chunks_done"] == info["chunks_total"] == 5
        return {p.name: p.read_bytes() for p in sorted(out.glob("chunk-*.jsonl.gz"))}

    one = chunks(tmp_path / "one")
    pool = ChunkPool(WorkerSpec(num_workers=2), threads=1, dtype="float32", max_new_tokens=5)
    try:
        two = chunks(tmp_path / "two", pool)
    finally:
        pool.close()
    assert two == one
    with pytest.raises(ConfigError, match=f"--num-workers {ray_cluster} needs {ray_cluster} CPUs"):
        ChunkPool(WorkerSpec(num_workers=ray_cluster), threads=1, dtype="float32", max_new_tokens=5)
