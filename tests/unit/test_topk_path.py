"""Top-1..4 hit rates along a target's greedy path, per exit and for the adaptive exit, against a direct count."""

from __future__ import annotations

import json

import torch

from helpers import save_tiny_llama
from s2d_ray.core.draft import SortedDraft
from s2d_ray.models import load_model
from s2d_ray.train.data import pack
from s2d_ray.train.forward import SubVocab
from s2d_ray.train.validate import TOPK, adaptive_correct, path_predictions, summarize


def direct_hits(model, docs, exit_layer: int, vocab_ids: torch.Tensor) -> list[float]:
    """Per document, one plain HF forward (no packing): exit hidden state -> final norm -> head rows of the draft's
    vocabulary -> top-4 full ids; hit@j = the next token among the first j."""
    hits, n = torch.zeros(TOPK), 0
    for ids, mask in docs:
        with torch.no_grad():
            h = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[exit_layer][0]
            logits = model.model.norm(h) @ model.lm_head.weight[vocab_ids].T
        top = vocab_ids[logits.topk(TOPK, -1).indices]  # [S, 4] full ids
        for t in range(len(ids) - 1):
            if mask[t + 1]:
                n += 1
                where = (top[t] == ids[t + 1]).nonzero()
                if len(where):
                    hits[int(where[0]):] += 1
    return (hits / n).tolist()


def test_topk_hits_per_exit_match_a_direct_count(tmp_path):
    directory = save_tiny_llama(tmp_path / "m", num_layers=3, dtype=torch.float64)
    base = load_model(str(directory), dtype=torch.float64)
    model = base.model
    g = torch.Generator().manual_seed(0)
    # Paths: the target's own tokens of rank 0, 1, 2, 3 and 6 in turn (so every top-j count differs).
    docs = []
    for i in range(6):
        ids = torch.randint(3, 320, (5 + i,), generator=g).tolist()
        n_prompt = len(ids)
        for t in range(12):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.topk(7).indices[(0, 1, 2, 3, 6)[(t + i) % 5]]))
        docs.append((ids, [False] * n_prompt + [True] * (len(ids) - n_prompt)))
    vocab_ids = torch.cat([torch.tensor([1, 2]), torch.randperm(317, generator=g)[:120] + 3]).sort().values
    vocab_ids = torch.unique(torch.cat([vocab_ids, torch.tensor([d[0][t] for d in docs for t in range(3, 12)])]))
    draft = SortedDraft.cut(model, str(directory), 3, [1, 3])
    rows = pack(docs, 24)  # several documents per packed row: positions and masks restart per document
    preds = path_predictions(draft.parts, draft.layers, rows, [1, 3], SubVocab(vocab_ids, 320))
    tau = float(torch.cat([p.conf[0] for p in preds]).median())  # exit 1 is chosen at about half the positions
    report = summarize(preds, [1, 3], [tau, 0.0])
    hit = report["topk_hit"]
    for exit_layer in (1, 3):
        got = hit[str(exit_layer)]
        want = direct_hits(model, docs, exit_layer, vocab_ids)
        assert got == [round(x, 4) for x in want], (exit_layer, got, want)
        assert got[0] == report["agree"][str(exit_layer)]  # top-1 hit is the agreement
        assert all(a <= b for a, b in zip(got, got[1:]))  # cumulative
    assert len(set(hit["3"])) == TOPK and hit["3"][-1] < 1  # every rank counts apart; rank 7 is no hit
    # Adaptive: the chosen exit's top-k, position by position.
    chosen = [adaptive_correct(p, [tau, 0.0])[1] for p in preds]
    n = sum(len(p.labels) for p in preds)
    want = [sum(int(p.labels[t] in p.topk[c[t], t, :j].tolist()) for p, c in zip(preds, chosen)
                for t in range(len(p.labels))) / n for j in range(1, TOPK + 1)]
    assert report["s2d_topk_hit"] == [round(x, 4) for x in want]
    assert {0, 1} <= {e for c in chosen for e in c}  # both exits were chosen somewhere: the test sees the choice


def test_profiles_without_topk_still_load(tmp_path, tiny_llama_dir):
    """Profiles written before top-k hit rates existed keep working (the engine reads thresholds and policy)."""
    from s2d_ray.build import build_engine
    from s2d_ray.config import DraftConfig, EngineConfig, TargetConfig

    draft = f"cut:{tiny_llama_dir}:2:1,2"
    old = {"target": str(tiny_llama_dir), "draft": draft, "exit_layers": [1, 2], "thresholds": [0.4, 0.0],
           "policy": "fixed", "k": 3, "on_path": {"tokens": 9, "agree": {"1": 0.1, "2": 0.2}, "s2d_agree": 0.2}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    cfg = EngineConfig(target=TargetConfig(name=str(tiny_llama_dir), calibration=str(path)),
                       draft=DraftConfig(source=draft), num_threads=1)
    assert build_engine(cfg).draft.spec.thresholds == [0.4, 0.0]
