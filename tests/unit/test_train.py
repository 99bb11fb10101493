"""SoFT training, data rendering, on-path simulation and calibration, on tiny random models (seconds each)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers import make_tiny_tokenizer, save_tiny_llama
from s2d_ray.core.costs import CostModel
from s2d_ray.train.data import is_heldout, pack, render_example
from s2d_ray.train.forward import SubVocab, exit_logits, simulate_mat, soft_loss
from s2d_ray.train.soft import Run, SoftConfig
from s2d_ray.train.validate import PathPreds, adaptive_correct, simulate_policy

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DRAFT = REPO / "s2d_ray" / "assets" / "drafts" / "smollm2-135m-s2d"


def write_rows(path: Path, n: int = 200) -> Path:
    """Instruction rows with a learnable pattern (the response repeats a counting phrase)."""
    rows = [{"id": f"r{i}", "source": "gsm8k_train" if i % 3 == 0 else "synthetic",
             "instruction": f"Count from {i} please.", "response": " ".join(["one two three four"] * 4)}
            for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def tiny_cfg(tmp_path: Path, model_dir: Path, **kw) -> SoftConfig:
    base = dict(target=str(model_dir), out=str(tmp_path / "run"), data=[str(write_rows(tmp_path / "d.jsonl"))],
                num_layers=2, exit_layers=[1, 2], seq_len=64, batch_size=4, steps=30, lr=1e-2, warmup=0.1,
                val_every=1000, ckpt_every=1000, val_examples=4, seed=0)
    base.update(kw)
    return SoftConfig(**base)


def exit_losses(run: Run) -> list[float]:
    with torch.no_grad():
        return run.loss_on(run.batch_at(0))[1]


def test_render_masks_only_assistant_tokens():
    tok = make_tiny_tokenizer()
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"},
                             {"from": "human", "value": "more"}, {"from": "gpt", "value": "sure thing"}]}
    ids, mask = render_example(tok, row)
    taught = tok.decode([i for i, m in zip(ids, mask) if m])
    assert taught == "hello there<|im_end|>\nsure thing<|im_end|>\n"


def test_pack_restarts_positions_and_isolates_documents():
    rows = pack([([5, 6, 7], [False, True, True]), ([8, 9], [False, True])], seq_len=8)
    assert len(rows) == 1
    r = rows[0]
    assert r.positions[0, :4].tolist() == [0, 1, 0, 0]  # doc 0 has 2 inputs, doc 1 has 1 input, then padding
    assert r.labels[0, :3].tolist() == [6, 7, 9]
    m = r.mask(torch.float32)[0, 0]
    assert m[2, 0] < 0 and m[1, 0] == 0  # doc 1 cannot see doc 0; doc 0 sees its own past


def test_heldout_split_is_stable_and_small():
    keys = [f"instruction {i}" for i in range(2000)]
    held = [k for k in keys if is_heldout(k)]
    assert held == [k for k in keys if is_heldout(k)]
    assert 10 < len(held) < 100


def test_simulated_mat_counts_runs_and_bonus_tokens():
    assert simulate_mat([True] * 12, k=5) == 12 / 2  # two rounds of 5 accepted + bonus
    assert simulate_mat([False] * 4, k=5) == 1.0
    assert simulate_mat([True, True, False, True], k=5) == 4 / 2
    mat, rounds = simulate_policy([True] * 20, "heuristic", k=5)
    assert rounds == 3 and mat == 20 / 3  # k grows 5 -> 7 -> 9


def test_adaptive_choice_uses_first_confident_exit():
    p = PathPreds(labels=torch.tensor([1, 2]), argmax=torch.tensor([[1, 9], [7, 2]]),
                  conf=torch.tensor([[0.9, 0.3], [0.1, 0.8]]))
    assert adaptive_correct(p, [0.5, 0.0]) == ([True, True], [0, 1])
    assert adaptive_correct(p, [0.95, 0.0]) == ([False, True], [1, 1])


def test_tiny_soft_run_lowers_every_exit_loss(tmp_path, tiny_llama_dir):
    run = Run(tiny_cfg(tmp_path, tiny_llama_dir))
    before = exit_losses(run)
    run.train(progress=False)
    after = exit_losses(run)
    assert all(a < b - 0.3 for a, b in zip(after, before)), (before, after)
    assert run.history and "teacher_forced" in run.history[-1]


def test_resume_continues_the_same_run(tmp_path, tiny_llama_dir):
    cfg = tiny_cfg(tmp_path, tiny_llama_dir, steps=8, ckpt_every=4)
    straight = Run(replace(cfg, out=str(tmp_path / "straight")))
    straight.train(progress=False)
    first = Run(cfg)
    first.train(progress=False, until=3)  # interrupted: the checkpoint holds step 3 (not a multiple of ckpt_every)
    second = Run(cfg)
    assert second.resume() and second.step == 3
    second.train(progress=False)
    for a, b in zip(straight.draft.layers.parameters(), second.draft.layers.parameters()):
        torch.testing.assert_close(a, b)


def test_kd_from_two_targets_runs_and_matters(tmp_path, tiny_llama_dir):
    other = save_tiny_llama(tmp_path / "other", seed=1)
    cfg = tiny_cfg(tmp_path, tiny_llama_dir, kd_targets=[str(tiny_llama_dir), str(other)], kd_weight=0.5,
                   kd_temperature=2.0, steps=3, vocab_size=64, train_norm_head=True)
    run = Run(cfg)
    assert len(run.kd_models) == 2
    batch = run.batch_at(0)
    with torch.no_grad():
        with_kd, _ = run.loss_on(batch)
        run.cfg.kd_weight = 0.0
        ce_only, _ = run.loss_on(batch)
        run.cfg.kd_weight = 0.5
    assert torch.isfinite(with_kd) and not torch.isclose(with_kd, ce_only)
    run.train(progress=False)
    assert run.step == 3


def test_kd_loss_is_zero_when_draft_equals_target():
    logits = torch.randn(5, 11)
    out = type("O", (), {"logits": [logits], "labels": torch.full((5,), -100)})()
    loss, _ = soft_loss(out, [1.0], kd=[logits.clone(), logits.clone()], kd_weight=1.0, temperature=2.0)
    assert abs(float(loss)) < 1e-5


@pytest.mark.parametrize("train_norm_head", [False, True])
def test_saved_draft_loads_with_reduced_vocab(tmp_path, tiny_llama_dir, train_norm_head):
    from safetensors import safe_open

    from s2d_ray.models import load_model
    from s2d_ray.models.drafts import load_draft

    run = Run(tiny_cfg(tmp_path, tiny_llama_dir, steps=2, vocab_size=40, train_norm_head=train_norm_head))
    run.train(progress=False)
    manifest = run.save_draft(tmp_path / "draft", "s2d train-draft ...", dtype=torch.float32)
    base = load_model(str(tiny_llama_dir))
    loaded = load_draft(tmp_path / "draft", base.model)
    assert loaded.spec.reduced_vocab == len(run.vocab.ids) and manifest["steps"] == 2
    batch = run.batch_at(0)
    ref = exit_logits(run.draft.parts, run.draft.layers, batch, [1, 2], run.vocab)
    got = exit_logits(loaded.parts, loaded.layers, batch, [1, 2], SubVocab(loaded.vocab_ids, 320))
    torch.testing.assert_close(ref.logits[-1], got.logits[-1], atol=1e-4, rtol=1e-4)
    with safe_open(str(tmp_path / "draft" / "draft.safetensors"), "pt") as fh:
        names = set(fh.keys())
    # A trained head is stored as its reduced-vocabulary rows only, never the full [V, h] matrix.
    assert ("head_rows" in names) == train_norm_head and not any(n.startswith("head.") for n in names)
    if train_norm_head:
        assert not torch.equal(loaded.parts.head.weight, base.model.lm_head.weight)
        assert torch.equal(base.model.lm_head.weight, load_model(str(tiny_llama_dir)).model.lm_head.weight)


def test_calibration_recovers_the_known_best_threshold():
    """Exit 2 is cheap and right exactly when its confidence is 0.75 (wrong at 0.65); exit 4 is dear and always
    right. The best threshold for exit 2 is therefore the grid value between them, 0.7, with long drafts."""
    from dataclasses import replace

    from s2d_ray.train.calibrate import Costs, fixed_exits, search, simulate_timed

    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 50, (400,), generator=g)
    conf0 = torch.where(torch.rand(400, generator=g) < 0.5, 0.75, 0.65)
    arg0 = torch.where(conf0 > 0.7, labels, labels + 1)
    preds = [PathPreds(labels, torch.stack([arg0, labels]), torch.stack([conf0, torch.ones(400)]))]
    costs = Costs(exit_token=[1.0, 10.0], head=0.1, verify={1: 20.0, 17: 40.0})
    ranked = search(preds, [2, 4], costs)
    best = ranked[0]
    assert best["thresholds"] == [0.7, 0.0]
    assert best["mat"] > 4 and (best["policy"] == "heuristic" or best["k"] >= 5)  # all-correct paths: long drafts
    same_policy = [r for r in ranked if (r["policy"], r["k"]) == (best["policy"], best["k"])]
    worse = next(r for r in same_policy if r["thresholds"] == [0.6, 0.0])
    assert worse["mat"] < best["mat"] and worse["speedup"] < best["speedup"]
    # A cheap exit right as often as the dear one but never confident: the search can stop there always (threshold 0)
    unsure = [PathPreds(labels, torch.stack([labels, labels]), torch.stack([torch.full((400,), 0.25),
                                                                          torch.ones(400)]))]
    assert search(unsure, [2, 4], costs)[0]["thresholds"] == [0.0, 0.0]
    # Each exit alone, as exit:<L> runs it: the cheap exit is wrong half the time, the dear one never; the adaptive
    # draft (cheap where it is right) beats both, the sorted draft's claim.
    alone = fixed_exits(preds, [2, 4], costs)
    assert alone["2"]["mat"] < 2 < alone["4"]["mat"] and best["speedup"] > max(a["speedup"] for a in alone.values())
    # exit 4 alone pays its own layers and head, not exit 2's head too (1 / 10, no 0.1 per token)
    mat4 = alone["4"]["mat"]
    tokens, rounds, secs = simulate_timed([True] * 400, [1] * 400, replace(costs, head=0.0), alone["4"]["policy"],
                                          alone["4"]["k"])
    assert mat4 == pytest.approx(tokens / rounds, abs=1e-4)
    assert alone["4"]["speedup"] == pytest.approx(tokens * costs.verify_n(1) / secs, abs=1e-4)


def test_measured_costs_have_one_entry_per_exit(tiny_llama_dir):
    from s2d_ray.core.draft import SortedDraft
    from s2d_ray.models import load_model
    from s2d_ray.train.calibrate import measure_costs

    base = load_model(str(tiny_llama_dir))
    draft = SortedDraft.cut(base.model, str(tiny_llama_dir), 2, [1, 2])
    costs = measure_costs(draft, base.model, list(range(3, 40)), repeat=1, k=3, batches=(1, 2, 4), positions=(1, 3))
    assert len(costs.exit_token) == 2 and all(c > 0 for c in costs.exit_token)
    assert set(costs.verify) == {1, 3} and costs.head > 0 and costs.draft_row >= 0
    assert {b: set(row) for b, row in costs.verify_grid.items()} == {1: {1, 3}, 2: {1, 3}, 4: {1, 3}}
    # The engine's cost model reads what calibration writes: the measured points back, in ms.
    model = CostModel.from_profile({"costs_ms": costs.to_profile()})
    assert model.verify(4, 3) == pytest.approx(1e3 * costs.verify_grid[4][3], abs=1e-3)
    assert model.draft(1) == pytest.approx(1e3 * costs.draft_token(1), abs=2e-3)


def test_calibrate_costs_only_refreshes_costs_and_keeps_acceptance(tmp_path, tiny_llama_dir, capsys):
    from s2d_ray.cli import main

    draft = f"cut:{tiny_llama_dir}:2:1,2"
    old = {"target": str(tiny_llama_dir), "draft": draft, "exit_layers": [1, 2], "thresholds": [0.4, 0.0],
           "policy": "fixed", "k": 3, "on_path": {"tokens": 99}, "measured_with": "float64, 1 threads",
           "costs_ms": {"exit_token": [9.0, 9.0], "extra_head": 9.0, "verify": {"1": 9.0}}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(old))
    rc = main(["calibrate", "--costs-only", "--profile", str(path), "--threads", "1", "--context", "24",
               "--repeats", "1"])
    assert rc == 0
    new = json.loads(path.read_text())
    assert {k: new[k] for k in ("thresholds", "policy", "k", "on_path")} == {k: old[k] for k in
                                                                               ("thresholds", "policy", "k", "on_path")}
    assert new["dtype"] == "float64" and new["costs_ms"]["exit_token"] != [9.0, 9.0]
    grid = new["costs_ms"]["verify_grid"]
    assert list(grid) == ["1", "2", "4", "8", "16"] and list(grid["16"]) == ["1", "2", "4", "8", "12", "16", "24", "32"]
    assert CostModel.from_profile(new).step(16) > 0
    assert main(["calibrate", "--costs-only", "--profile", str(tmp_path / "missing.json")]) != 0
    assert "does not exist" in capsys.readouterr().err


def test_calibrate_cli_writes_a_profile_the_engine_reads(tmp_path, tiny_llama_dir, capsys):
    from s2d_ray.build import build_engine
    from s2d_ray.cli import main
    from s2d_ray.config import DraftConfig, EngineConfig, TargetConfig

    rows = write_rows(tmp_path / "rows.jsonl")
    out = tmp_path / "profile.json"
    draft = f"cut:{tiny_llama_dir}:2:1,2"
    rc = main(["calibrate", "--target", str(tiny_llama_dir), "--draft", draft, "--out", str(out), "--data", str(rows),
               "--num-prompts", "3", "--max-new-tokens", "8", "--threads", "1"])
    assert rc == 0
    profile = json.loads(out.read_text())
    assert profile["exit_layers"] == [1, 2] and len(profile["thresholds"]) == 2 and profile["thresholds"][-1] == 0.0
    assert profile["policy"] in ("fixed", "heuristic") and profile["calibration_set"]["responses"] >= 1
    hits = profile["on_path"]["topk_hit"]  # what a tree can accept, per exit: top-1..4
    assert set(hits) == {"1", "2"} and all(len(h) == 4 and h[0] == profile["on_path"]["agree"][e]
                                           for e, h in hits.items())
    assert len(profile["on_path"]["s2d_topk_hit"]) == 4
    assert set(profile["fixed_exits_modelled"]) == {"1", "2"}  # each exit alone, the adaptive draft's rivals
    cfg = EngineConfig(target=TargetConfig(name=str(tiny_llama_dir), calibration=str(out)),
                       draft=DraftConfig(source=draft), num_threads=1)
    assert build_engine(cfg).draft.spec.thresholds == profile["thresholds"]
    # A retrained draft of the same shape costs the same: --costs-from takes a profile's costs (every machine's)
    # instead of measuring them; one of another shape is refused in one line.
    again = tmp_path / "again.json"
    common = ["calibrate", "--target", str(tiny_llama_dir), "--draft", draft, "--paths",
              str(out.with_suffix(".paths.jsonl")), "--threads", "1", "--costs-from", str(out)]
    assert main(common + ["--out", str(again)]) == 0
    borrowed = json.loads(again.read_text())
    assert borrowed["costs_ms"] == profile["costs_ms"] and borrowed["costs_from"] == str(out)
    assert borrowed["on_path"] == profile["on_path"] and borrowed["thresholds"] == profile["thresholds"]
    capsys.readouterr()
    assert main(common + ["--out", str(tmp_path / "x.json"), "--exits", "2"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("s2d: error: ")]
    assert len(err) == 1 and "--costs-from" in err[0] and "exit_layers" in err[0]


def test_train_draft_cli_rejects_kd_without_targets(tmp_path, capsys):
    from s2d_ray.cli import main

    rc = main(["train-draft", "--out", str(tmp_path / "r"), "--data", str(tmp_path / "rows.jsonl"),
               "--kd-weight", "0.5"])
    assert rc == 2 and "--kd-target" in capsys.readouterr().err


@pytest.mark.real
@pytest.mark.skipif(not DEFAULT_DRAFT.is_dir(), reason="the default draft is committed by the training task")
def test_committed_default_draft_loads_and_matches_its_manifest(smollm2):
    from s2d_ray.models.drafts import load_draft

    manifest = json.loads((DEFAULT_DRAFT / "MANIFEST.json").read_text())
    draft = load_draft(DEFAULT_DRAFT, smollm2.model)
    cfg = manifest["config"]
    assert draft.spec.num_layers == cfg["num_layers"] and draft.spec.exit_layers == cfg["exit_layers"]
    assert (draft.vocab_ids is None) == (not cfg["vocab_size"])
    assert draft.spec.provenance["steps"] == manifest["steps"]
    assert sum(f.stat().st_size for f in DEFAULT_DRAFT.rglob("*") if f.is_file()) < 100 * 2**20
    assert "train-draft" in manifest["command"] and manifest["data_sha256_16"]


def test_extract_answer_prefers_the_gsm8k_marker():
    from s2d_ray.train.lora import extract_answer

    assert extract_answer("so 3 + 4 = 7\n#### 1,234") == "1234"
    assert extract_answer("The answer is 18.") == "18"
    assert extract_answer("no digits") is None


def test_lora_adapter_trains_and_loads_as_a_named_source(tmp_path, tiny_llama_dir):
    from s2d_ray.models import NAMED_SOURCES, NamedSource, load_model, register_source
    from s2d_ray.train.lora import train_lora

    rows = write_rows(tmp_path / "rows.jsonl")
    info = train_lora(str(tiny_llama_dir), rows, tmp_path / "adapter", steps=3, batch_size=2, lr=1e-2, rank=4)
    assert info["steps"] == 3 and (tmp_path / "adapter" / "adapter_config.json").is_file()
    # the base as it was named, not where its converted copy lies on this machine
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(tiny_llama_dir)
    register_source(NamedSource(name="tiny-lora-test", base=str(tiny_llama_dir), adapter_dir=tmp_path / "adapter"))
    try:
        merged = load_model("tiny-lora-test", cache_dir=tmp_path / "cache")
        base = load_model(str(tiny_llama_dir))
        q_merged = merged.model.model.layers[0].self_attn.q_proj.weight
        assert not torch.equal(q_merged, base.model.model.layers[0].self_attn.q_proj.weight)
    finally:
        NAMED_SOURCES.pop("tiny-lora-test", None)


def test_lora_adapter_trains_on_the_sources_given(tmp_path, tiny_llama_dir):
    from s2d_ray.train.lora import train_lora

    rows = write_rows(tmp_path / "rows.jsonl")
    info = train_lora(str(tiny_llama_dir), rows, tmp_path / "adapter", steps=2, batch_size=2, lr=1e-2, rank=2,
                      sources=("synthetic",), max_len=512)
    assert info["sources"] == ["synthetic"] and info["max_len"] == 512
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "TRAINING.json", "adapter_config.json", "adapter_model.safetensors"]  # no empty model card
    with pytest.raises(ValueError, match="no train rows of sources"):  # none of that source, or none short enough
        train_lora(str(tiny_llama_dir), rows, tmp_path / "none", steps=1, sources=("nothing",))
    with pytest.raises(ValueError, match="fit in 2 tokens"):
        train_lora(str(tiny_llama_dir), rows, tmp_path / "none", steps=1, sources=("synthetic",), max_len=2)


def test_export_from_checkpoint_equals_the_saved_draft(tmp_path, tiny_llama_dir):
    from safetensors.torch import load_file

    from s2d_ray.train.soft import export_checkpoint

    run = Run(tiny_cfg(tmp_path, tiny_llama_dir, steps=2, vocab_size=40, ckpt_every=1))
    run.train(progress=False)
    run.save_draft(tmp_path / "saved", "cmd")
    manifest = export_checkpoint(tmp_path / "run", tmp_path / "exported", "cmd")
    a, b = load_file(str(tmp_path / "saved" / "draft.safetensors")), load_file(str(tmp_path / "exported" / "draft.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert manifest["steps"] == 2


def test_a_deeper_draft_grows_from_a_trained_shallower_one(tmp_path):
    """--init with fewer layers than the run: its layers (and trained norm and head rows) come first, the target's
    next layer after; a deeper --init is refused: a deeper draft starts from the trained one."""
    from s2d_ray.models import load_model
    from s2d_ray.models.drafts import load_draft

    target_dir = save_tiny_llama(tmp_path / "tiny3", num_layers=3)
    small = Run(tiny_cfg(tmp_path, target_dir, out=str(tmp_path / "run_a"), steps=3, vocab_size=40,
                         train_norm_head=True))
    small.train(progress=False)
    small.save_draft(tmp_path / "small", "cmd", dtype=torch.float32)
    deep = Run(tiny_cfg(tmp_path, target_dir, out=str(tmp_path / "run_b"), steps=1, num_layers=3,
                        exit_layers=[1, 2, 3], vocab_size=40, train_norm_head=True, init=str(tmp_path / "small")))
    target = load_model(str(target_dir)).model
    for i, layer in enumerate(deep.draft.layers):
        source = small.draft.layers[i] if i < 2 else target.model.layers[i]
        mine, ref = layer.state_dict(), source.state_dict()
        assert all(torch.equal(mine[k].float(), ref[k].float()) for k in ref), i
    trained, cut = small.draft.layers[0].self_attn.q_proj.weight, target.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(trained, cut)  # the first layers are the trained ones, not the target's
    torch.testing.assert_close(deep.head_rows, small.head_rows)
    deep.save_draft(tmp_path / "deep", "cmd", dtype=torch.float32)
    with pytest.raises(ValueError, match="3 layers, this run 2"):
        Run(tiny_cfg(tmp_path, target_dir, out=str(tmp_path / "run_c"), steps=1, vocab_size=40,
                     init=str(tmp_path / "deep")))
    assert load_draft(tmp_path / "deep", target).spec.num_layers == 3


def test_topk_kd_equals_full_kd_restricted_to_the_top_k():
    """The cached loss is the full-logit KD of the target renormalised over its top-k ids in the draft vocabulary:
    exact when k covers the vocabulary, and a direct sum over those ids otherwise."""
    from s2d_ray.train.forward import TopK

    g = torch.Generator().manual_seed(0)
    full_size, ids = 40, torch.tensor([0, 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37])
    vocab = SubVocab(ids, full_size)
    target = torch.randn(6, full_size, generator=g, dtype=torch.float64) * 3
    draft = torch.randn(6, len(ids), generator=g, dtype=torch.float64, requires_grad=True)
    out = type("O", (), {"logits": [draft], "labels": torch.full((6,), -100)})()
    temp = 2.0
    dense, _ = soft_loss(out, [1.0], kd=[target[:, ids]], kd_weight=1.0, temperature=temp)
    top = target.topk(full_size, -1)  # k = the whole vocabulary: the full KD
    cached, _ = soft_loss(out, [1.0], kd=[TopK.of(top.values, top.indices, vocab)], kd_weight=1.0, temperature=temp)
    torch.testing.assert_close(cached, dense)
    top = target.topk(8, -1)
    got, _ = soft_loss(out, [1.0], kd=[TopK.of(top.values, top.indices, vocab)], kd_weight=1.0, temperature=temp)
    logq = torch.log_softmax(draft / temp, -1)
    want = 0.0
    for n in range(6):
        keep = [int(i) for i in top.indices[n] if int(i) in ids.tolist()]  # top-8 ids that the draft can propose
        logp = torch.log_softmax(target[n, keep] / temp, -1)
        want = want + (logp.exp() * (logp - logq[n, [ids.tolist().index(i) for i in keep]])).sum()
    torch.testing.assert_close(got, want / 6 * temp**2)
    # A position none of whose top-k ids is in the draft vocabulary adds nothing (and no NaN gradient).
    none = TopK.of(torch.randn(1, 2, dtype=torch.float64), torch.tensor([[1, 4]]), vocab)
    assert float(none.kl(logq[:1].detach(), temp)) == 0.0
    got.backward()
    assert torch.isfinite(draft.grad).all()


def test_kd_cache_replaces_the_target_forward(tmp_path, tiny_llama_dir):
    """Training from the cache matches full-logit KD (k = vocabulary), builds lazily only the chunks steps reach
    (keeping those a killed build wrote) and is keyed to the rows: a different packing is refused."""
    from s2d_ray.train.data import visit_order
    from s2d_ray.train.kdcache import TopKCache, target_cache_dir

    other = save_tiny_llama(tmp_path / "other", seed=1)
    kw = dict(kd_targets=[str(tiny_llama_dir), str(other)], kd_weight=1.0, kd_temperature=2.0, vocab_size=64,
              train_norm_head=True, steps=4)
    dense = Run(tiny_cfg(tmp_path, tiny_llama_dir, **kw))
    cache_dir = tmp_path / "cache"
    # A build killed after two chunks (in the run's visiting order: batch_size 4 = chunk_rows, so chunk s is step s).
    part = TopKCache(target_cache_dir(cache_dir, str(other)), str(other), dense.rows, 320, "float32",
                     order=visit_order(len(dense.rows), 0, 0))
    part.build(dense.kd_models[1], progress=False)
    for p in sorted(part.directory.glob("part-*.pt"))[2:]:
        p.unlink()
    cached = Run(tiny_cfg(tmp_path, tiny_llama_dir, out=str(tmp_path / "run2"), kd_cache=str(cache_dir), kd_topk=320,
                          **kw))
    assert len(cached.kd_caches) == 2 and [c.built for c in cached.kd_caches] == [0, 0]  # nothing built up front
    for step in (0, 3):
        batch = dense.batch_at(step)
        with torch.no_grad():
            a, per_a = dense.loss_on(batch)
            b, per_b = cached.loss_on(batch)
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)  # logits stored in float16
    # Steps 0 and 3 needed chunks 0 and 3: the first target built both, the second only chunk 3 (0 was kept).
    assert [c.built for c in cached.kd_caches] == [2, 1]
    assert sorted(p.name for p in cached.kd_caches[0].directory.glob("part-*.pt")) == ["part-000000.pt",
                                                                                       "part-000003.pt"]
    small = Run(tiny_cfg(tmp_path, tiny_llama_dir, out=str(tmp_path / "run3"), kd_cache=str(tmp_path / "c8"),
                         kd_topk=8, **kw))
    with torch.no_grad():
        loss8 = small.loss_on(small.batch_at(0))[0]
    assert torch.isfinite(loss8) and not torch.isclose(loss8, dense.loss_on(dense.batch_at(0))[0].detach())
    small.train(progress=False)
    assert small.step == 4
    with pytest.raises(ValueError, match="other rows"):
        Run(tiny_cfg(tmp_path, tiny_llama_dir, out=str(tmp_path / "run4"), kd_cache=str(cache_dir), kd_topk=320,
                     seq_len=48, **kw))


def test_exit_distill_teaches_shallow_exits_from_the_detached_deepest():
    g = torch.Generator().manual_seed(0)
    shallow = torch.randn(5, 9, generator=g, dtype=torch.float64, requires_grad=True)
    deep = torch.randn(5, 9, generator=g, dtype=torch.float64, requires_grad=True)
    out = type("O", (), {"logits": [shallow, deep], "labels": torch.full((5,), -100)})()  # no CE: only the new term
    loss, per_exit = soft_loss(out, [1.0, 1.0], exit_distill=0.5, temperature=2.0)
    p, logq = torch.softmax(deep / 2, -1), torch.log_softmax(shallow / 2, -1)
    want = 0.5 * 4 * (p * (p.log() - logq)).sum(-1).mean()
    torch.testing.assert_close(loss, (want / 2).float())  # soft_loss computes in float32
    assert per_exit[1] == 0.0
    loss.backward()
    assert deep.grad.abs().max() == 0 and shallow.grad.abs().max() > 0  # the deepest exit is the teacher only
    same = type("O", (), {"logits": [deep, deep], "labels": torch.full((5,), -100)})()
    assert float(soft_loss(same, [1.0, 1.0], exit_distill=1.0)[0].detach()) == pytest.approx(0.0, abs=1e-7)


def test_exit_distill_reaches_the_trainer(tmp_path, tiny_llama_dir):
    run = Run(tiny_cfg(tmp_path, tiny_llama_dir, exit_distill=1.0, exit_weights=[2.0, 1.0], steps=2))
    with torch.no_grad():
        with_term = run.loss_on(run.batch_at(0))
        run.cfg.exit_distill = 0.0
        without = run.loss_on(run.batch_at(0))
    assert with_term[1][0] > without[1][0] and with_term[1][1] == without[1][1]


def test_validation_reports_every_targets_held_out_paths(tmp_path, tiny_llama_dir):
    from s2d_ray.train.data import read_rows
    from s2d_ray.train.selfdistill import generate_responses, pick_rows

    other = save_tiny_llama(tmp_path / "other", seed=1)
    rows = pick_rows(write_rows(tmp_path / "d.jsonl"), None, 0, "heldout")
    files = []
    for name, target in (("paths_a", tiny_llama_dir), ("paths_b", other)):
        files.append(tmp_path / f"{name}.jsonl")
        generate_responses(str(target), rows, files[-1], max_new_tokens=6)
    run = Run(tiny_cfg(tmp_path, tiny_llama_dir, onpath_data=[str(f) for f in files], steps=1, val_examples=50))
    out = run.validator.run()
    assert set(out["on_path_by_file"]) == {"paths_a", "paths_b"} and out["on_path"] == out["on_path_by_file"]["paths_a"]
    for f in files:
        want = sum(len(r["response_ids"]) for r in read_rows(f))
        got = out["on_path_by_file"][f.stem]
        assert got["tokens"] == want and len(got["topk_hit"]["2"]) == 4
    single = Run(tiny_cfg(tmp_path, tiny_llama_dir, out=str(tmp_path / "one"), onpath_data=str(files[1]), steps=1,
                          val_examples=50))
    assert single.validator.run()["on_path"] == out["on_path_by_file"]["paths_b"]


def test_kd_cache_built_in_bfloat16_is_close_and_kept_apart(tmp_path, tiny_llama_dir):
    kw = dict(kd_targets=[str(tiny_llama_dir)], kd_weight=1.0, vocab_size=64, steps=2, kd_topk=320)
    fp32 = Run(tiny_cfg(tmp_path, tiny_llama_dir, kd_cache=str(tmp_path / "c32"), **kw))
    bf16 = Run(tiny_cfg(tmp_path, tiny_llama_dir, out=str(tmp_path / "r16"), kd_cache=str(tmp_path / "c16"),
                        kd_cache_dtype="bfloat16", **kw))
    meta = json.loads(next((tmp_path / "c16").glob("*/kdcache.json")).read_text())
    assert meta["dtype"] == "bfloat16"
    assert not torch.equal(bf16.kd_caches[0].load().values, fp32.kd_caches[0].load().values)  # really built in bf16
    with torch.no_grad():
        a, b = fp32.loss_on(fp32.batch_at(0))[0], bf16.loss_on(bf16.batch_at(0))[0]
    torch.testing.assert_close(a, b, atol=0.05, rtol=0.02)
    with pytest.raises(ValueError, match="other rows or settings"):
        Run(tiny_cfg(tmp_path, tiny_llama_dir, out=str(tmp_path / "r3"), kd_cache=str(tmp_path / "c32"),
                     kd_cache_dtype="bfloat16", **kw))


@pytest.mark.parametrize("flags, built", [((), "float32"), (("avx512_bf16",), "bfloat16")])
def test_kd_cache_dtype_auto_builds_in_what_this_cpu_runs_fast(tmp_path, tiny_llama_dir, monkeypatch, flags, built):
    """bf16 only where the CPU has native bf16 (without it, bf16 matmuls run far slower than fp32)."""
    from s2d_ray import hardware as dtypes

    monkeypatch.setattr(dtypes, "cpu_flags", lambda: frozenset(flags))
    Run(tiny_cfg(tmp_path, tiny_llama_dir, kd_targets=[str(tiny_llama_dir)], kd_weight=1.0, vocab_size=64, steps=2,
                 kd_topk=16, kd_cache=str(tmp_path / "c"), kd_cache_dtype="auto", device="cpu"))
    assert json.loads(next((tmp_path / "c").glob("*/kdcache.json")).read_text())["dtype"] == built


# --- devices: --device auto|cpu|cuda; checkpoints hold CPU tensors and resume on any device -------------------------


def cpu_tensors_only(state) -> bool:
    if isinstance(state, torch.Tensor):
        return state.device.type == "cpu"
    if isinstance(state, dict):
        return all(cpu_tensors_only(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return all(cpu_tensors_only(v) for v in state)
    return True


def leaves(state) -> list:
    if isinstance(state, dict):
        return [x for k in sorted(state, key=str) for x in leaves(state[k])]
    if isinstance(state, (list, tuple)):
        return [x for v in state for x in leaves(v)]
    return [state]


def device_kw(tmp_path: Path, tiny_llama_dir: Path) -> dict:
    """Every path a step can take: two KD targets from a top-k cache, own norm/head rows, a reduced vocabulary."""
    other = tmp_path / "other"
    if not other.exists():
        save_tiny_llama(other, seed=1)
    return dict(kd_targets=[str(tiny_llama_dir), str(other)], kd_weight=1.0, kd_temperature=2.0,
                kd_cache=str(tmp_path / "kdcache"), kd_topk=16, vocab_size=64, train_norm_head=True,
                steps=4, val_every=2, ckpt_every=2)


def test_device_cpu_is_the_default_on_a_cpu_machine(tmp_path, tiny_llama_dir, monkeypatch):
    """`auto` on a machine without a GPU and an explicit `cpu` are the same run: losses, metrics, weights, state."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    kw = device_kw(tmp_path, tiny_llama_dir)
    auto = Run(tiny_cfg(tmp_path, tiny_llama_dir, out=str(tmp_path / "auto"), **kw))
    cpu = Run(tiny_cfg(tmp_path, tiny_llama_dir, out=str(tmp_path / "cpu"), device="cpu", **kw))
    assert auto.cfg.device == "auto" and auto.device == cpu.device == torch.device("cpu")
    for run in (auto, cpu):
        run.train(progress=False)
    untimed = [[{k: v for k, v in h.items() if k != "wall_s"} for h in run.history] for run in (auto, cpu)]
    assert untimed[0] == untimed[1] and len(auto.history) == 3  # steps 0, 2 and 4, losses and metrics exactly
    for a, b in zip(auto.params, cpu.params):
        assert torch.equal(a, b)
    ck_auto, ck_cpu = (torch.load(tmp_path / d / "checkpoint.pt", weights_only=False) for d in ("auto", "cpu"))
    assert ck_cpu["cfg"]["device"] == "cpu" and ck_auto["cfg"]["device"] == "auto"
    for key in ("opt", "model", "vocab_ids"):
        flat_a, flat_b = leaves(ck_auto[key]), leaves(ck_cpu[key])
        assert len(flat_a) == len(flat_b) and all(
            torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(flat_a, flat_b))


def test_checkpoint_resumes_on_another_device(tmp_path, tiny_llama_dir, monkeypatch):
    """A checkpoint holds CPU tensors only and loads with map_location="cpu"; one written on a GPU machine (its cfg
    says cuda, and it checkpointed at another interval) resumes here to the same weights as an uninterrupted run."""
    kw = device_kw(tmp_path, tiny_llama_dir) | dict(steps=6, val_every=1000, ckpt_every=1000)
    straight = Run(tiny_cfg(tmp_path, tiny_llama_dir, out=str(tmp_path / "straight"), device="cpu", **kw))
    straight.train(progress=False)
    first = Run(tiny_cfg(tmp_path, tiny_llama_dir, device="cpu", **kw))
    first.train(progress=False, until=3)
    path = tmp_path / "run" / "checkpoint.pt"
    ck = torch.load(path, weights_only=False)
    assert cpu_tensors_only(ck) and ck["opt"]["state"]  # the optimiser's moments travel too
    ck["cfg"].update(device="cuda", ckpt_every=25)  # as the GPU machine wrote it
    torch.save(ck, path)
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(k.get("map_location")) or real_load(*a, **k))
    second = Run(tiny_cfg(tmp_path, tiny_llama_dir, device="cpu", **kw))
    assert second.resume() and second.step == 3 and "cpu" in loads
    second.train(progress=False)
    for a, b in zip(straight.params, second.params):
        torch.testing.assert_close(a, b)
    ck["cfg"]["lr"] = 1.0  # what a step computes may not change
    torch.save(ck, path)
    with pytest.raises(ValueError, match="different configuration"):
        Run(tiny_cfg(tmp_path, tiny_llama_dir, device="cpu", **kw)).resume()


def test_a_run_moves_to_a_machine_without_its_checkpoint_or_kd_cache(tmp_path, tiny_llama_dir):
    """What crosses machines is the exported draft (bf16, no optimiser) and the data: the run continues at the same
    step, tokens and curve, its learning rate warms up again, and the lazily built KD cache is rebuilt only for the
    chunks still ahead (batch_size 4 = chunk_rows, so chunk s is step s)."""
    import shutil

    kw = dict(kd_targets=[str(tiny_llama_dir)], kd_weight=1.0, kd_cache=str(tmp_path / "cache"), kd_topk=16,
              vocab_size=64, train_norm_head=True, steps=8, val_every=4, warmup=0.25)
    first = Run(tiny_cfg(tmp_path, tiny_llama_dir, **kw))
    first.train(progress=False, until=4)
    first.save_draft(tmp_path / "carry", "cmd")
    assert len(list((tmp_path / "cache").rglob("part-*.pt"))) == 4
    shutil.rmtree(tmp_path / "cache")
    (tmp_path / "run" / "checkpoint.pt").unlink()  # a new machine: only what the repo holds came along
    # ... and it keeps its run and cache elsewhere, with another thread count and the cache built in another dtype
    # (what this machine computes fast): still the same run
    second = Run(tiny_cfg(tmp_path, tiny_llama_dir, **(kw | {"kd_cache": str(tmp_path / "cache2")}), threads=1,
                      out=str(tmp_path / "moved"), kd_cache_dtype="bfloat16"))
    assert not second.resume()
    second.cfg.data = [os.path.relpath(second.cfg.data[0])]  # the same file named from the working directory
    second.resume_from_draft(tmp_path / "carry")
    assert (second.step, second.tokens, second.history) == (first.step, first.tokens, first.history)
    for a, b in zip(first.params, second.params):
        torch.testing.assert_close(b, a.detach().to(torch.bfloat16).float())  # the export's bf16 rounding, no more
    assert second.opt.param_groups[0]["lr"] == pytest.approx(first.opt.param_groups[0]["lr"] / 2)  # rewarm 1 of 2
    second.train(progress=False)
    assert second.step == 8 and all(math.isfinite(x) for x in second.last_losses)
    assert sorted(p.name for p in (tmp_path / "cache2").rglob("part-*.pt")) == [f"part-{c:06d}.pt" for c in range(4, 8)]
    assert {json.loads(m.read_text())["dtype"] for m in (tmp_path / "cache2").rglob("kdcache.json")} == {"bfloat16"}
    ck = torch.load(tmp_path / "moved" / "checkpoint.pt", weights_only=False)
    assert ck["rewarm_from"] == 4  # a later resume from the checkpoint keeps the same schedule
    with pytest.raises(ValueError, match="different configuration"):
        Run(tiny_cfg(tmp_path, tiny_llama_dir, out=str(tmp_path / "other"), **(kw | {"lr": 1.0}))).resume_from_draft(
            tmp_path / "carry")


def test_autocast_runs_the_draft_in_bfloat16_close_to_float32(tmp_path, tiny_llama_dir, monkeypatch):
    from s2d_ray import hardware as dtypes
    from s2d_ray.train.soft import resolve_autocast

    kw = dict(steps=3, vocab_size=64, train_norm_head=True)
    fp32 = Run(tiny_cfg(tmp_path, tiny_llama_dir, **kw))
    bf16 = Run(tiny_cfg(tmp_path, tiny_llama_dir, out=str(tmp_path / "bf"), autocast="bfloat16", **kw))
    assert bf16.autocast and not fp32.autocast
    with torch.no_grad():
        a, b = fp32.loss_on(fp32.batch_at(0))[0], bf16.loss_on(bf16.batch_at(0))[0]
    assert not torch.equal(a, b)  # the matmuls really ran in bf16
    torch.testing.assert_close(a, b, atol=0.05, rtol=0.02)
    bf16.train(progress=False)
    assert all(math.isfinite(x) for x in bf16.last_losses) and all(p.dtype == torch.float32 for p in bf16.params)
    cpu = torch.device("cpu")
    monkeypatch.setattr(dtypes, "cpu_flags", lambda *a: frozenset({"avx2"}))
    assert not resolve_autocast("auto", cpu) and not resolve_autocast(None, cpu)
    monkeypatch.setattr(dtypes, "cpu_flags", lambda *a: frozenset({"avx512_bf16"}))
    assert resolve_autocast("auto", cpu)
    with pytest.raises(ValueError, match="autocast must be"):
        resolve_autocast("float16", cpu)


def test_unknown_or_missing_device_is_refused(tmp_path, tiny_llama_dir, monkeypatch):
    from s2d_ray.train.soft import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no GPU"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="device must be one of"):
        resolve_device("tpu")


def test_train_draft_cli_device_and_time_limit(tmp_path, tiny_llama_dir, capsys):
    """--device reaches the config; --time-limit 0 stops after the first step, checkpointed, and --save still writes."""
    from s2d_ray.cli import main

    data = write_rows(tmp_path / "d.jsonl")
    rc = main(["train-draft", "--target", str(tiny_llama_dir), "--out", str(tmp_path / "r"), "--data", str(data),
               "--save", str(tmp_path / "draft"), "--layers", "2", "--exits", "1,2", "--seq-len", "64",
               "--batch-size", "4", "--steps", "5", "--val-every", "1000", "--ckpt-every", "1000",
               "--val-examples", "4", "--device", "cpu", "--time-limit", "0", "--no-progress"])
    assert rc == 0 and json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"] == 1
    ck = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=False)
    assert ck["step"] == 1 and ck["cfg"]["device"] == "cpu" and (tmp_path / "draft" / "draft.safetensors").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_run_trains_and_its_checkpoint_resumes_on_the_cpu(tmp_path, tiny_llama_dir):
    """On the GPU: every tensor a step touches is there, the KD cache is built there but stored on the CPU, losses
    are finite and close to the CPU's; the checkpoint resumes on the CPU and continues."""
    kw = device_kw(tmp_path, tiny_llama_dir) | dict(steps=6, val_every=3, ckpt_every=1000)
    gpu = Run(tiny_cfg(tmp_path, tiny_llama_dir, device="cuda", **kw))
    assert gpu.device.type == "cuda" and all(p.device.type == "cuda" for p in gpu.params)
    assert all(c.load().values.device.type == "cpu" for c in gpu.kd_caches)  # built on the GPU, kept on the CPU
    for p in sorted((tmp_path / "kdcache").rglob("part-*.pt")):
        assert cpu_tensors_only(torch.load(p))
    cpu = Run(tiny_cfg(tmp_path, tiny_llama_dir, out=str(tmp_path / "cpu"), device="cpu", **kw))  # the same cache
    with torch.no_grad():
        loss_gpu, loss_cpu = gpu.loss_on(gpu.batch_at(0))[0], cpu.loss_on(cpu.batch_at(0))[0]
    assert loss_gpu.device.type == "cuda" and torch.isfinite(loss_gpu)
    torch.testing.assert_close(loss_gpu.cpu(), loss_cpu, atol=1e-3, rtol=1e-3)
    gpu.train(progress=False, until=4)
    assert all(math.isfinite(x) for x in gpu.last_losses) and "on_path" not in gpu.history[-1]
    assert gpu.history[-1]["teacher_forced"]["tokens"] > 0
    ck = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert ck["step"] == 4 and cpu_tensors_only(ck)
    back = Run(tiny_cfg(tmp_path, tiny_llama_dir, device="cpu", **kw))
    assert back.resume() and back.step == 4
    for a, b in zip(back.params, gpu.params):
        torch.testing.assert_close(a, b.cpu())
    back.train(progress=False)
    assert back.step == 6 and all(math.isfinite(x) for x in back.last_losses)
    gpu.save_draft(tmp_path / "gpu-draft", "cmd")  # export straight from the GPU run
    assert (tmp_path / "gpu-draft" / "draft.safetensors").exists()


def test_kd_cache_built_several_chunks_per_forward_has_the_same_parts(tmp_path, tiny_llama_dir):
    """What a GPU does (16 chunks a forward) writes the parts one chunk a forward writes, chunk by chunk."""
    from s2d_ray.models import load_model
    from s2d_ray.train.kdcache import TopKCache

    run = Run(tiny_cfg(tmp_path, tiny_llama_dir, steps=1))
    model = load_model(str(tiny_llama_dir)).model
    one = TopKCache(tmp_path / "one", "t", run.rows, 8, "float32")
    many = TopKCache(tmp_path / "many", "t", run.rows, 8, "float32")
    one.build(model, progress=False)
    (many.directory / "part-000002.pt").parent.mkdir(parents=True)
    many.missing()
    torch.save(torch.load(one._part(2)), many._part(2))  # a resumed build: chunks that are done are skipped
    assert many.build(model, progress=False, chunks_per_forward=3) == len(list(one.directory.glob("part-*"))) - 1
    for c in one._chunks():
        a, b = torch.load(one._part(c)), torch.load(many._part(c))
        assert torch.equal(a["counts"], b["counts"]) and torch.equal(a["ids"], b["ids"])
        torch.testing.assert_close(a["values"], b["values"], atol=1e-3, rtol=1e-3)
    one.load(), many.load()
    batch = run.batch_at(0)
    assert torch.equal(one.lookup(batch, run.vocab).index, many.lookup(batch, run.vocab).index)
