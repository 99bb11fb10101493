"""LoRA adapters on tensor-parallel ranks (core/lora.py's Split, serve/tp_lora.py): two gloo ranks, each holding its
cut of every adapter, decode each adapter's rows exactly as that adapter merged into the base decodes on one process,
two adapters and the base batched in one forward. Both ways a rank gets its shard are covered: read as a shard
(models/shards.py, float64) and cut by DeepSpeed AutoTP (its LinearLayer / LinearAllreduce, float32: DeepSpeed's CPU
path has no float64; its MLP split is uneven here, all of it on rank 0). Negative controls: the row-parallel delta
added after the all-reduce on every rank, or column shards given the other rank's rows of B, give wrong logits; B left
whole is refused. A bad adapter is refused by both ranks alike."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from core_fixtures import tiny_target
from helpers import make_tiny_llama, merge_lora, save_random_lora

TESTS = str(Path(__file__).resolve().parents[1])
WORLD = 2
NAMES = ["a", "b", ""]  # two adapters and the base, rows of all three in every forward
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
NEW_TOKENS = 12


def _requests(merged: bool = False):
    from s2d_ray.core.engine import GenerationRequest

    return [GenerationRequest(f"{n or 'base'}-{i}", p, NEW_TOKENS, adapter="" if merged else n)
            for n in NAMES for i, p in enumerate(PROMPTS)]


def _scores(merged: bool = False):
    from s2d_ray.core.types import ScoreRequest

    return [ScoreRequest(f"{n or 'base'}-{i}", p, len(p), adapter="" if merged else n)
            for n in NAMES for i, p in enumerate(PROMPTS)]


def _decode(verifier) -> dict[str, list[int]]:
    from s2d_ray.core.engine import SpecEngine

    return {r.seq_id: r.token_ids for r in SpecEngine(verifier, None).generate(_requests(verifier.lora is None))}


def _lora_verifier(model, splits, paths):
    from s2d_ray.core.lora import LoraBank
    from s2d_ray.core.target import TargetVerifier
    from s2d_ray.models.adapters import read_peft_adapter

    bank = LoraBank(max_loaded=4, max_rank=8, splits=splits)
    verifier = TargetVerifier(model, lora=bank)
    for name in ("a", "b"):
        bank.register(read_peft_adapter(paths[name], name))
    widest = []  # distinct adapters in each forward
    bind = bank.bind
    bank.bind = lambda names, device: (widest.append(len(set(names) - {""})), bind(names, device))[1]
    return verifier, widest


def _logits(verifier) -> list[list[list[float]]]:
    return [t.tolist() for t in verifier.score(_scores())]


def _rank(rank: int, tmp: str) -> None:
    sys.path.insert(0, TESTS)
    torch.set_num_threads(1)
    import dataclasses

    import deepspeed
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from s2d_ray.core.lora import AdapterError, LoraProjection
    from s2d_ray.models.shards import load_sharded
    from s2d_ray.serve.tp import rank_env
    from s2d_ray.serve.tp_lora import lora_splits, register_on_rank

    tmp_path = Path(tmp)
    os.environ.update(rank_env(rank, WORLD, int((tmp_path / "port").read_text())))
    deepspeed.init_distributed(verbose=False, timeout=timedelta(seconds=120))  # a stuck rank fails, never hangs
    paths = {n: str(tmp_path / n) for n in ("a", "b", "other")}
    out: dict = {}

    # Read as a shard (the served path for safetensors checkpoints), float64.
    model = load_sharded(tmp_path / "base", rank, WORLD, torch.float64, dist.all_reduce)
    splits = lora_splits(model, "shard", rank, WORLD)
    out["shard_kinds"] = sorted({("out" if s.out else "in") + ":" + k.split(".")[-1] for k, s in splits.items()})
    verifier, widest = _lora_verifier(model, splits, paths)
    out["shard_tokens"] = _decode(verifier)
    out["shard_widest"] = max(widest)
    out["shard_logits"] = _logits(verifier)
    out["refused"] = register_on_rank(verifier.lora, "other", paths["other"])
    out["refused_leaves_adapters"] = sorted(verifier.lora.registered)

    # Negative control: the row-parallel delta added after the all-reduce, on every rank.
    verifier, _ = _lora_verifier(model, splits, paths)
    for module in verifier.stack.layers.modules():
        if isinstance(module, LoraProjection) and module.reduce is not None:
            module.reduce = None  # forward then runs base(x) (reduced inside) + this rank's partial delta
    out["after_reduce_logits"] = _logits(verifier)

    # Negative control: each column shard takes the other rank's rows of B.
    def other_rows(split):
        size = split.out.stop - split.out.start
        start = (split.out.start + size) % split.full[0]
        return dataclasses.replace(split, out=slice(start, start + size))

    swapped = {k: other_rows(s) if s.out is not None else s for k, s in splits.items()}
    out["swapped_logits"] = _logits(_lora_verifier(model, swapped, paths)[0])

    # Negative control: B left whole on column shards is refused (its rows do not fit the shard).
    try:
        _lora_verifier(model, {k: s for k, s in splits.items() if s.out is None}, paths)
        out["whole_b"] = None
    except AdapterError as exc:
        out["whole_b"] = str(exc)

    # Cut by DeepSpeed AutoTP (the path for other checkpoints), float32.
    whole = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    engine = deepspeed.init_inference(whole, tensor_parallel={"tp_size": WORLD}, dtype=torch.float32,
                                      replace_with_kernel_inject=False)
    splits = lora_splits(engine.module, "whole", rank, WORLD)
    out["ds_splits"] = {k: [s.full, [s.out.start, s.out.stop] if s.out else None,
                            [s.in_.start, s.in_.stop] if s.in_ else None] for k, s in splits.items()}
    verifier, widest = _lora_verifier(engine.module, splits, paths)
    out["ds_tokens"] = _decode(verifier)
    out["ds_widest"] = max(widest)
    dist.destroy_process_group()
    (tmp_path / f"rank{rank}.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from s2d_ray.serve.tp import free_port

    tmp = tmp_path_factory.mktemp("lora-tp")
    base = tiny_target(seed=0, num_layers=2)  # float64, GQA 4/2 heads: whole heads on each of 2 ranks
    base.save_pretrained(tmp / "base")
    save_random_lora(base, tmp / "a", seed=1)
    save_random_lora(base, tmp / "b", seed=2, r=2, modules=["q_proj", "v_proj", "o_proj", "down_proj"], rslora=True)
    save_random_lora(make_tiny_llama(vocab_size=96, hidden_size=48, dtype=torch.float64), tmp / "other", seed=3)
    (tmp / "port").write_text(str(free_port()))
    mp.start_processes(_rank, args=(str(tmp),), nprocs=WORLD, start_method="spawn")
    return tmp, base, [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _merged(base, tmp: Path, dtype: torch.dtype) -> dict:
    return {n: (merge_lora(base, tmp / n) if n else base).to(dtype) for n in NAMES}


def _reference(models: dict) -> dict[str, list[int]]:
    """Each adapter's rows decoded plainly on its merged model, on one process."""
    from s2d_ray.core.engine import SpecEngine
    from s2d_ray.core.target import TargetVerifier

    out = {}
    for name, model in models.items():
        for r in SpecEngine(TargetVerifier(model), None).generate(_requests(merged=True)):
            if r.seq_id.startswith(f"{name or 'base'}-"):
                out[r.seq_id] = r.token_ids
    return out


def _reference_logits(models: dict) -> list[torch.Tensor]:
    """Each row's logits over its prompt, on its merged model alone."""
    from s2d_ray.core.target import TargetVerifier

    names = [n for n in NAMES for _ in PROMPTS]
    return [TargetVerifier(models[n]).score([req])[0] for n, req in zip(names, _scores(merged=True))]


def test_sharded_adapters_decode_as_merged_on_one_rank(ranks):
    tmp, base, outs = ranks
    expected = _reference(_merged(base, tmp, torch.float64))
    for i in range(len(PROMPTS)):  # the adapters change the output, or equality proves nothing
        assert len({tuple(expected[f"{n or 'base'}-{i}"]) for n in NAMES}) == 3
    assert outs[0]["shard_kinds"] == ["in:down_proj", "in:o_proj", "out:gate_proj", "out:k_proj", "out:q_proj",
                                      "out:up_proj", "out:v_proj"]
    for o in outs:
        assert o["shard_tokens"] == expected
        assert o["shard_widest"] == 2  # both adapters in one forward


def test_sharded_logits_match_merged_and_wrong_cuts_do_not(ranks):
    tmp, base, outs = ranks
    want = _reference_logits(_merged(base, tmp, torch.float64))
    adapted = range(2 * len(PROMPTS))  # rows of adapters a and b; the rest are the base's

    def gaps(key):
        return [(torch.tensor(outs[0][key][j], dtype=torch.float64) - want[j]).abs().max().item()
                for j in range(len(want))]

    assert max(gaps("shard_logits")) < 1e-10
    for key in ("after_reduce_logits", "swapped_logits"):
        got = gaps(key)
        assert all(got[j] > 1e-3 for j in adapted), (key, got)
        assert all(got[j] < 1e-10 for j in range(len(want)) if j not in adapted), (key, got)  # base rows untouched
    assert "features" in outs[0]["whole_b"] and "another base" in outs[0]["whole_b"]


def test_autotp_shards_decode_as_merged_on_one_rank(ranks):
    tmp, base, outs = ranks
    expected = _reference(_merged(base, tmp, torch.float32))
    splits = [o["ds_splits"] for o in outs]
    # AutoTP kept whole heads per rank and gave rank 0 the whole MLP (64 < its grain): the slices are its own.
    assert splits[0]["0.self_attn.q_proj"] == [[32, 32], [0, 16], None]
    assert splits[1]["0.self_attn.o_proj"] == [[32, 32], None, [16, 32]]
    assert splits[1]["0.mlp.down_proj"] == [[32, 64], None, [64, 64]]
    for o in outs:
        assert o["ds_tokens"] == expected
        assert o["ds_widest"] == 2


def test_a_bad_adapter_is_refused_alike_by_every_rank(ranks):
    from s2d_ray.serve.tp_lora import group_adapter_answer

    _, _, outs = ranks
    answers = [o["refused"] for o in outs]
    assert "error" in answers[0] and answers[0] == answers[1]
    assert all(o["refused_leaves_adapters"] == ["a", "b"] for o in outs)
    assert group_adapter_answer(answers) == (answers[0], False)
    # ranks that disagree: the group answers the refusal and undoes the load on every rank
    assert group_adapter_answer([{"loaded": "x"}, answers[1]]) == ({"error": answers[1]["error"]}, True)
    assert group_adapter_answer([{"loaded": "x"}, {"loaded": "x"}]) == ({"loaded": "x"}, False)


def test_a_split_cuts_the_factors_as_the_layer_is_cut():
    from s2d_ray.core.lora import Split

    a, b = torch.arange(12.0).reshape(2, 6), torch.arange(16.0).reshape(8, 2)
    col = Split((8, 6), out=slice(4, 8))
    assert col.held() == (4, 6) and col.cut(a, b)[0].equal(a) and col.cut(a, b)[1].equal(b[4:])
    row = Split((8, 6), in_=slice(0, 3), reduce=lambda t: None)
    assert row.held() == (8, 3) and row.cut(a, b)[0].equal(a[:, :3]) and row.cut(a, b)[1].equal(b)
    assert row.cut(a, b)[0].is_contiguous()
    with pytest.raises(ValueError, match="needs the group's sum"):
        Split((8, 6), in_=slice(0, 3))  # a row-parallel cut without its all-reduce would add a partial delta
    with pytest.raises(ValueError, match="not both"):
        Split((8, 6), out=slice(0, 4), in_=slice(0, 3), reduce=lambda t: None)


def test_a_bank_refuses_splits_that_do_not_fit_its_layers():
    from s2d_ray.core.lora import LoraBank, Split

    layers = tiny_target(num_layers=1).model.layers  # q_proj: 32 -> 32
    with pytest.raises(ValueError, match="its weight is"):
        LoraBank(splits={"0.self_attn.q_proj": Split((32, 32), out=slice(0, 8))}).wrap(layers)
    with pytest.raises(ValueError, match="do not have"):
        LoraBank(splits={"0.self_attn.qkv": Split((32, 32), out=slice(0, 32))}).wrap(layers)
