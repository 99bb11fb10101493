"""Teacher-forced forwards for training and measurement: every exit of a draft, and a target, over packed batches.

The draft's own decoder layers are called directly (full sequences, causal per document, no KV cache), so training
sees exactly the computation inference runs. Logits are computed only at labelled positions and, with a reduced
vocabulary, only for the draft's token subset: the LM head is the expensive part on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core.decoder import decoder_parts
from .data import Packed


@dataclass
class ExitOut:
    """Per exit, logits [N, V'] at the N labelled positions; labels [N] in the same (sub)vocabulary (-100: none)."""

    logits: list[torch.Tensor]
    labels: torch.Tensor
    select: torch.Tensor  # [B, S] bool: the labelled positions


class SubVocab:
    """Maps full-vocabulary ids to a draft subset (or is the identity for the full vocabulary)."""

    def __init__(self, vocab_ids: torch.Tensor | None, full_size: int) -> None:
        self.ids = None if vocab_ids is None else vocab_ids.sort().values
        self.full_size = full_size
        self.index = None
        if self.ids is not None:
            self.index = torch.full((full_size,), -100, dtype=torch.long)
            self.index[self.ids] = torch.arange(len(self.ids))

    def map_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return labels if self.index is None else self.index[labels]

    def head_weight(self, head: nn.Module) -> torch.Tensor:
        return head.weight if self.ids is None else head.weight[self.ids]

    def to_full(self, sub_ids: torch.Tensor) -> torch.Tensor:
        return sub_ids if self.ids is None else self.ids[sub_ids]

    def to(self, device: torch.device | str) -> "SubVocab":
        """Moves the id maps to `device` (where the labels and logits they index live); returns self."""
        if self.ids is not None:
            self.ids, self.index = self.ids.to(device), self.index.to(device)
        return self


def module_device(module: nn.Module) -> torch.device:
    """Where a module's weights live (the device its inputs must be on)."""
    return next(module.parameters()).device


def run_layers(parts, layers: nn.ModuleList, batch: Packed, exits: list[int]) -> list[torch.Tensor]:
    """Hidden states [B, S, h] after each exit layer (before the final norm)."""
    x = parts.embed(batch.ids)
    mask = batch.mask(x.dtype)
    cos_sin = parts.rotary(x, position_ids=batch.positions)
    outs = []
    for i, layer in enumerate(layers[: exits[-1]]):
        out = layer(x, attention_mask=mask, position_ids=batch.positions, position_embeddings=cos_sin)
        x = out[0] if isinstance(out, tuple) else out
        if i + 1 in exits:
            outs.append(x)
    return outs


def exit_logits(parts, layers, batch: Packed, exits: list[int], vocab: SubVocab, head_weight=None) -> ExitOut:
    """Logits at every exit for the labelled positions (norm + head; head_weight overrides the shared rows), on the
    layers' device (the batch is moved there)."""
    batch = batch.to(module_device(parts.embed))
    select = batch.labels != -100
    hiddens = run_layers(parts, layers, batch, exits)
    weight = head_weight if head_weight is not None else vocab.head_weight(parts.head)
    logits = [F.linear(parts.norm(h[select]), weight) for h in hiddens]
    return ExitOut(logits, vocab.map_labels(batch.labels[select]), select)


@torch.no_grad()
def target_logits(model: nn.Module, batch: Packed, vocab: SubVocab) -> torch.Tensor:
    """A target's logits [N, V'] at the labelled positions of a packed batch (same masks and positions), on the
    model's device (the batch is moved there)."""
    parts = decoder_parts(model)
    batch = batch.to(module_device(model))
    (h,) = run_layers(parts, parts.layers, batch, [len(parts.layers)])
    h = parts.norm(h[batch.labels != -100])
    return F.linear(h, vocab.head_weight(parts.head)).float()


@dataclass
class TopK:
    """A target's k largest logits per position (values [N, k]; index [N, k] into the draft's vocabulary; valid
    [N, k]: the id is in that vocabulary). KD from it renormalises the target over the valid ids (kdcache.py)."""

    values: torch.Tensor
    index: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def of(cls, values: torch.Tensor, full_ids: torch.Tensor, vocab: SubVocab) -> "TopK":
        index = vocab.map_labels(full_ids)
        valid = index >= 0
        return cls(values, index.clamp(min=0), valid)

    def kl(self, logq: torch.Tensor, temperature: float) -> torch.Tensor:
        """Mean over positions of KL(target restricted to its valid top-k || draft), logq: the draft's log-probs."""
        # A finite fill, not -inf: a position with no valid id must give 0, not NaN (in the loss and its gradient).
        logp = torch.log_softmax((self.values / temperature).masked_fill(~self.valid, -1e4), -1)
        terms = logp.exp() * (logp - logq.gather(-1, self.index))
        return terms.masked_fill(~self.valid, 0.0).sum() / max(len(self.values), 1)


def kd_divergence(logq: torch.Tensor, target: torch.Tensor | TopK, temperature: float) -> torch.Tensor:
    """KL(target_T || draft_T) averaged over positions, from full logits [N, V'] or a cached top-k."""
    if isinstance(target, TopK):
        return target.kl(logq, temperature)
    return F.kl_div(logq, F.log_softmax(target / temperature, -1), log_target=True, reduction="batchmean")


def soft_loss(out: ExitOut, weights: list[float], kd: list[torch.Tensor | TopK] | None = None, kd_weight: float = 0.0,
              temperature: float = 1.0, exit_distill: float = 0.0,
              shares: tuple[float, float] = (1.0, 1.0)) -> tuple[torch.Tensor, list[float]]:
    """SoFT: weighted mean over exits of CE (and, with kd, the KL to each target's tempered distribution: full
    logits, or a cached top-k). exit_distill > 0 adds, at every shallower exit, that weight times the KL from the
    deepest exit's distribution (detached: the deepest exit is the teacher, not pulled towards the shallow ones).

    `shares` scale the CE mean and the per-position means (KD, exit distillation): a data-parallel rank passes its
    part of the global batch's counts times the world size, so that the gradients averaged over ranks are the
    gradient of the global batch's means (distributed.py)."""
    total, per_exit = 0.0, []
    deepest = out.logits[-1].detach().float() if exit_distill > 0 else None
    for i, (w, logits) in enumerate(zip(weights, out.logits)):
        valid = int((out.labels != -100).sum())  # labels outside a reduced vocabulary carry no CE
        loss = F.cross_entropy(logits.float(), out.labels, ignore_index=-100, reduction="sum") / max(valid, 1)
        loss = loss * shares[0]
        if kd and kd_weight > 0:
            logq = F.log_softmax(logits.float() / temperature, -1)
            kl = sum(kd_divergence(logq, t, temperature) for t in kd) / len(kd)
            loss = (1 - kd_weight) * loss + kd_weight * kl * temperature**2 * shares[1]
        if deepest is not None and i < len(out.logits) - 1:
            logq = F.log_softmax(logits.float() / temperature, -1)
            loss = loss + exit_distill * kd_divergence(logq, deepest, temperature) * temperature**2 * shares[1]
        total = total + w * loss
        per_exit.append(float(loss.detach()))
    return total / sum(weights), per_exit


def simulate_mat(correct: list[bool], k: int) -> float:
    """Greedy speculation along a target path, fixed draft length k: tokens per target forward (bonus included)."""
    t, rounds = 0, 0
    while t < len(correct):
        run = 0
        while run < k and t + run < len(correct) and correct[t + run]:
            run += 1
        t += run + 1
        rounds += 1
    return len(correct) / rounds if rounds else 0.0
