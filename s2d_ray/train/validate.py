"""Held-out measurement of a sorted draft: per-exit agreement, teacher-forced and along the target's own path.

Along the target's own greedy path, greedy speculation is fully determined by teacher-forced predictions: a round
that starts at position t accepts the run of consecutive correct draft tokens from t (up to k), then the target adds
one. The adaptive exit choice depends only on the prefix, which is the path. So mean accepted tokens (MAT) for any
exits, thresholds and draft-length policy can be computed exactly from one forward per held-out response.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .data import Packed, load_examples, pack
from .forward import SubVocab, exit_logits, module_device, simulate_mat, target_logits

logger = logging.getLogger(__name__)


TOPK = 4  # top-1..4 hit rates: what a tree of width up to 4 can accept along the path


@dataclass
class PathPreds:
    """One held-out response: labels [T] (target tokens), argmax [E, T] (full ids) and confidence [E, T] per exit;
    topk [E, T, K] the K most likely full ids per exit, best first (argmax == topk[..., 0])."""

    labels: torch.Tensor
    argmax: torch.Tensor
    conf: torch.Tensor
    topk: torch.Tensor | None = None


@torch.no_grad()
def path_predictions(parts, layers, rows: list[Packed], exits: list[int], vocab: SubVocab,
                     head_weight=None, labels_from=None) -> list[PathPreds]:
    """Per document, every exit's greedy token and max-probability at each labelled position (computed on the
    layers' device, returned on the CPU)."""
    out: list[PathPreds] = []
    device = module_device(parts.embed)
    for row in rows:
        row = row.to(device)
        res = exit_logits(parts, layers, row, exits, vocab, head_weight)
        labels = row.labels[res.select] if labels_from is None else labels_from(row)
        docs = row.doc[res.select]
        probs = [torch.softmax(lg.float(), -1) for lg in res.logits]
        conf = torch.stack([p.amax(-1) for p in probs])
        arg = torch.stack([vocab.to_full(p.argmax(-1)) for p in probs])
        top = torch.stack([vocab.to_full(p.topk(min(TOPK, p.shape[-1]), -1).indices) for p in probs])
        labels, docs, conf, arg, top = (t.cpu() for t in (labels, docs, conf, arg, top))
        for d in docs.unique(sorted=True).tolist():
            sel = docs == d
            out.append(PathPreds(labels[sel], arg[:, sel], conf[:, sel], top[:, sel]))
    return out


def adaptive_correct(p: PathPreds, thresholds: list[float]) -> tuple[list[bool], list[int]]:
    """Correctness and exit index of the adaptive draft token at each position (the last exit always emits)."""
    e = p.conf.shape[0]
    chosen = torch.full(p.labels.shape, e - 1, dtype=torch.long)
    for i in reversed(range(e - 1)):
        chosen = torch.where(p.conf[i] > thresholds[i], torch.full_like(chosen, i), chosen)
    tok = p.argmax.gather(0, chosen[None])[0]
    return (tok == p.labels).tolist(), chosen.tolist()


def simulate_policy(correct: list[bool], policy: str = "fixed", k: int = 5, max_k: int = 16) -> tuple[float, int]:
    """MAT and number of rounds along a path for `fixed` k or the paper's heuristic (+2 all accepted, else -1)."""
    if policy == "fixed":
        mat = simulate_mat(correct, k)
        return mat, round(len(correct) / mat) if mat else 0
    t, rounds, cur = 0, 0, k
    while t < len(correct):
        run = 0
        while run < cur and t + run < len(correct) and correct[t + run]:
            run += 1
        cur = min(cur + 2, max_k) if run == cur else max(cur - 1, 1)
        t += run + 1
        rounds += 1
    return (len(correct) / rounds if rounds else 0.0), rounds


def topk_hits(preds: list[PathPreds], exit_index: int | None = None, thresholds: list[float] | None = None
              ) -> list[float]:
    """Top-1..K hit rates along the paths: the share of positions whose target token is among the draft's K most
    likely, at one exit, or (exit_index None) at the exit the adaptive rule picks with `thresholds`."""
    n = sum(len(p.labels) for p in preds)
    hits = torch.zeros(TOPK)
    for p in preds:
        if exit_index is None:
            chosen = adaptive_correct(p, thresholds)[1]
            top = p.topk.gather(0, torch.tensor(chosen)[None, :, None].expand(1, -1, p.topk.shape[-1]))[0]
        else:
            top = p.topk[exit_index]
        found = (top == p.labels[:, None]).long().cumsum(-1).clamp(max=1)  # [T, K]: hit within the first j+1
        hits[: found.shape[-1]] += found.sum(0).float()
        hits[found.shape[-1] :] += found[:, -1].sum().float()  # fewer than K ids in the vocabulary
    return [float(h) / max(n, 1) for h in hits]


def summarize(preds: list[PathPreds], exits: list[int], thresholds: list[float], k: int = 5) -> dict:
    """Per-exit agreement, top-1..4 hit rates and simulated MAT (fixed k), plus the adaptive draft's, over all
    held-out paths."""
    n = sum(len(p.labels) for p in preds)
    agree = [sum(int((p.argmax[i] == p.labels).sum()) for p in preds) / max(n, 1) for i in range(len(exits))]
    mats = [_mean_mat([(p.argmax[i] == p.labels).tolist() for p in preds], k) for i in range(len(exits))]
    adaptive = [adaptive_correct(p, thresholds)[0] for p in preds]
    out = {"tokens": n, "agree": dict(zip(map(str, exits), _r(agree))),
           "mat_k5": dict(zip(map(str, exits), _r(mats))),
           "s2d_agree": round(sum(map(sum, adaptive)) / max(n, 1), 4), "s2d_mat_k5": round(_mean_mat(adaptive, k), 4)}
    if preds and all(p.topk is not None for p in preds):
        out["topk_hit"] = {str(e): _r(topk_hits(preds, i)) for i, e in enumerate(exits)}
        out["s2d_topk_hit"] = _r(topk_hits(preds, None, thresholds))
    return out


def _mean_mat(corrects: list[list[bool]], k: int) -> float:
    """Token-weighted MAT over paths: total tokens / total rounds."""
    tokens = sum(len(c) for c in corrects)
    rounds = sum(simulate_policy(c, "fixed", k)[1] for c in corrects if c)
    return tokens / rounds if rounds else 0.0


def _r(xs: list[float]) -> list[float]:
    return [round(x, 4) for x in xs]


class Validator:
    """Fixed held-out sets: training-style text labelled by the target's greedy token, and the target's own paths."""

    def __init__(self, run, cfg) -> None:
        self.owner = run
        tok = run.target.tokenizer
        text = load_examples([Path(p) for p in cfg.data], tok, "heldout", cfg.val_examples, cfg.sources)
        self.text_rows = pack(text, 1024) if text else []
        # Relabel held-out text with the target's greedy next token (what the draft must agree with).
        full = SubVocab(None, run.vocab.full_size)
        self.text_labels = [target_logits(run.target.model, r, full).argmax(-1) for r in self.text_rows]
        # One or several targets' held-out greedy paths (a str: one file, as older configs store it).
        files = [cfg.onpath_data] if isinstance(cfg.onpath_data, str) else list(cfg.onpath_data or [])
        self.path_sets = {Path(f).stem: pack(load_examples([Path(f)], tok, "heldout", cfg.val_examples), 1024)
                          for f in files if Path(f).exists()}

    def run(self) -> dict:
        r = self.owner
        exits = r.cfg.exits()
        thresholds = r.draft.spec.thresholds
        head = r.head_rows
        out = {}
        if self.text_rows:
            labels = iter(self.text_labels)
            preds = path_predictions(r.draft.parts, r.draft.layers, self.text_rows, exits, r.vocab, head,
                                     labels_from=lambda row: next(labels))
            out["teacher_forced"] = summarize(preds, exits, thresholds)
        by_file = {name: summarize(path_predictions(r.draft.parts, r.draft.layers, rows, exits, r.vocab, head),
                                   exits, thresholds) for name, rows in self.path_sets.items() if rows}
        if by_file:
            out["on_path"] = next(iter(by_file.values()))  # the first file: the curve's series
        if len(by_file) > 1:
            out["on_path_by_file"] = by_file
        return out
