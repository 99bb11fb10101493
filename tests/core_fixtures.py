"""Tiny float64 target/draft pairs with a realistic mix of exits, accepts and rejects, for exactness tests."""

from __future__ import annotations

import copy

import torch
from torch import nn

from helpers import make_tiny_llama
from s2d_ray.core.draft import DraftSpec, SortedDraft
from s2d_ray.core.decoder import decoder_parts
from s2d_ray.core.kernels import Kernels
from s2d_ray.kernels import CpuKernels

# The CPU backend the shipped entry points inject (grouped attention, projections chosen by measurement): the
# exactness tests run the path users run.
KERNELS = CpuKernels()


def tiny_target(seed: int = 0, num_layers: int = 4, vocab_size: int = 96, scale: float = 4.0) -> nn.Module:
    """A random Llama whose logits are peaky enough that confidences spread over (0, 1)."""
    model = make_tiny_llama(vocab_size=vocab_size, num_layers=num_layers, seed=seed, dtype=torch.float64)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(scale)
    return model


def noisy_draft(target: nn.Module, num_layers: int = 3, exits: list[int] | None = None,
                thresholds: list[float] | None = None, noise: float = 0.08, seed: int = 1,
                kernels: Kernels = KERNELS) -> SortedDraft:
    """The target's first layers plus noise: a draft that agrees often, not always (like a trained one)."""
    layers = nn.ModuleList(copy.deepcopy(list(target.model.layers)[:num_layers]))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layers.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * noise)
    exits = exits or list(range(1, num_layers + 1))
    thresholds = thresholds if thresholds is not None else [0.05] * (len(exits) - 1) + [0.0]
    return SortedDraft(decoder_parts(target), DraftSpec("tiny", num_layers, exits, thresholds), layers,
                       kernels=kernels)


def random_prompts(n: int, vocab_size: int = 96, seed: int = 0, lo: int = 3, hi: int = 17) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=gen).tolist()
    return [torch.randint(3, vocab_size, (m,), generator=gen).tolist() for m in lens]
