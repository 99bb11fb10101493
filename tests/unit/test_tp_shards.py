"""Tensor-parallel ranks read only their shard (meta-device construction, safetensors slices): three gloo ranks give
the whole model's logits (float64), each holds about a third of the layers' weights, and loading a shard peaks below
loading the whole model. A request every rank refuses (before any collective) fails alone: the same group answers
the next request; ranks that disagree, or a failed collective, break the group."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from helpers import save_tiny_llama
from s2d_ray.serve.tp import RankFailure, TPGroupError, TPRequestError, group_answers

TESTS = str(Path(__file__).resolve().parents[1])
WORLD = 3


def _big_model(directory: Path) -> Path:
    """~100 MB of float32 layers with head counts that split over 3 ranks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=576, intermediate_size=2304, num_hidden_layers=6,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(directory)
    return directory


def _small(directory: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.float64).save_pretrained(directory)
    return directory


def _peak_delta(load) -> int:
    from s2d_ray.models.shards import peak_rss_bytes, reset_peak_rss
    from s2d_ray.serve.replica import return_freed_memory

    return_freed_memory()
    reset_peak_rss()
    before = peak_rss_bytes()
    model = load()
    for p in model.parameters():  # weights mapped from the file count once they are read (every forward does)
        p.sum()
    return peak_rss_bytes() - before, sum(p.numel() * p.element_size() for p in model.parameters())


def _rank(rank: int, tmp: str) -> None:
    sys.path.insert(0, TESTS)
    torch.set_num_threads(1)
    import torch.distributed as dist

    from s2d_ray.core.target import TargetVerifier
    from s2d_ray.core.types import ScoreRequest
    from s2d_ray.models.shards import load_sharded
    from s2d_ray.serve.tp import score_or_failure

    out: dict = {}
    tmp_path = Path(tmp)
    if rank == WORLD:  # the whole model, as every rank loaded it before
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(tmp_path / "small", dtype=torch.float64)  # imports and warm-up
        out["peak"], out["bytes"] = _peak_delta(
            lambda: AutoModelForCausalLM.from_pretrained(tmp_path / "big", dtype=torch.float32))
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=(tmp_path / "port").read_text())
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        reduce = dist.all_reduce
        model = load_sharded(tmp_path / "small", rank, WORLD, torch.float64, reduce)
        verifier = TargetVerifier(model)
        good = [ScoreRequest("a", [5, 6, 7, 8, 9, 10], 3), ScoreRequest("b", [11, 12, 13], 2)]
        bad = [ScoreRequest("c", [5, 6, 4000], 1)]  # an id past the vocabulary: every rank refuses it
        failed = score_or_failure(rank, verifier, bad, [0])
        out["bad"] = [failed.error, failed.collective] if isinstance(failed, RankFailure) else None
        answer = score_or_failure(rank, verifier, good, [0, 0])  # the same group, after the failure
        if rank == 0:
            out["logits"] = [t.tolist() for t in answer[0]]
        out["peak"], out["bytes"] = _peak_delta(lambda: load_sharded(tmp_path / "big", rank, WORLD,
                                                                     torch.float32, reduce))
        dist.destroy_process_group()
    (tmp_path / f"rank{rank}.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from s2d_ray.serve.tp import free_port

    tmp = tmp_path_factory.mktemp("tp")
    _small(tmp / "small")
    _big_model(tmp / "big")
    (tmp / "port").write_text(str(free_port()))
    mp.start_processes(_rank, args=(str(tmp),), nprocs=WORLD + 1, start_method="spawn")
    return tmp, [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD + 1)]


def test_three_shards_give_the_whole_models_logits(ranks):
    from transformers import AutoModelForCausalLM

    from s2d_ray.core.target import TargetVerifier
    from s2d_ray.core.types import ScoreRequest

    tmp, outs = ranks
    whole = TargetVerifier(AutoModelForCausalLM.from_pretrained(tmp / "small", dtype=torch.float64))
    expected = whole.score([ScoreRequest("a", [5, 6, 7, 8, 9, 10], 3), ScoreRequest("b", [11, 12, 13], 2)])
    for got, want in zip(outs[0]["logits"], expected):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=0, atol=1e-10)


def test_a_request_every_rank_refuses_leaves_the_group_answering(ranks):
    _, outs = ranks
    assert all(o["bad"] is not None and o["bad"][1] is False and "IndexError" in o["bad"][0] for o in outs[:WORLD])
    assert outs[0]["logits"]  # the next call through the same group succeeded (previous test: exactly)


def test_shard_loading_peaks_below_the_whole_model(ranks):
    _, outs = ranks
    whole = outs[WORLD]
    for o in outs[:WORLD]:
        assert o["bytes"] < 0.45 * whole["bytes"]  # a third of the layers, embeddings and norms whole
        assert o["peak"] < 0.5 * whole["peak"], (o["peak"], whole["peak"])


def test_group_answers_tells_a_bad_request_from_a_broken_group():
    ok = [(["x"], [0]), None, None]
    assert group_answers("score", ok) == ok
    refused = [RankFailure(r, "IndexError: index out of range", False) for r in range(3)]
    with pytest.raises(TPRequestError, match="every TP rank refused"):
        group_answers("score", refused)
    # negative controls: one rank alone failing, or a collective failing, is a broken group
    with pytest.raises(TPGroupError, match="rank 1"):
        group_answers("score", [ok[0], refused[1], None])
    with pytest.raises(TPGroupError):
        group_answers("score", [RankFailure(r, "DistBackendError: peer closed", True) for r in range(3)])
