"""A decoder-only LM as embedding -> layers split at exits -> shared norm + LM head, run over rows of a slot cache.

Both the target (one exit, after its last layer) and the sorted draft (several exits) are a `LayerStack`: they call the
Hugging Face decoder layers directly (core/decoder.py), so any Llama-like family works, and the positions of every
call are explicit. Which sequence holds which cache row, and how much of it holds KV, is core/rows.py's.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from .attention import plan_kv_groups
from .cache import SlotKVCache, additive_mask, head_mask, slot_mask
from .decoder import DecoderParts, cache_kwarg
from .errors import ModelLoadError
from .kernels import ATTENTION_CASES, STOCK, AttentionShape, Kernels, PassRunner, attention_case

logger = logging.getLogger(__name__)


class LayerStack(nn.Module):
    """Layers 1..exit_layers[-1] of a decoder, cut into segments that end at each exit; norm and head shared.

    `kernels` (core/kernels.py) chooses how attention and projections run: the default runs the model's own; a
    backend may route attention through the slot cache's grouped path and swap projections for faster ones."""

    def __init__(
        self,
        parts: DecoderParts,
        exit_layers: list[int],
        layers: nn.ModuleList | None = None,
        vocab_ids: torch.Tensor | None = None,
        kernels: Kernels = STOCK,
    ) -> None:
        super().__init__()
        self.parts = parts
        # A reduced-vocabulary head (draft only): logits for `vocab_ids`, -inf elsewhere. Verification stays exact
        # because the target checks every token; the draft just never proposes the rest.
        self.vocab_ids = vocab_ids
        self._head_rows = None if vocab_ids is None else parts.head.weight.detach()[vocab_ids].clone()
        self.exit_layers = list(exit_layers)
        self.layers = layers if layers is not None else nn.ModuleList(list(parts.layers)[: exit_layers[-1]])
        if len(self.layers) < exit_layers[-1]:
            raise ModelLoadError(f"exit {exit_layers[-1]} is deeper than the {len(self.layers)} layers available")
        bounds = [0, *exit_layers]
        self.segments = list(zip(bounds[:-1], bounds[1:]))
        self.backend = kernels
        # grouped: attention runs through the slot cache's grouped path (core/attention.py: row groups, cache runs,
        # query blocks), its innermost kernel SDPA for the kinds of pass in `sdpa_cases`; else the model's own
        # attention, a mask per head.
        attention = kernels.attention(self.layers, AttentionShape(parts.num_heads, parts.num_kv_heads, parts.head_dim,
                                                                  self.dtype, self.device))
        self.grouped, self.sdpa_cases = attention.grouped, attention.sdpa
        self.per_query = attention.per_query  # each query row alone, as a decode step computes it
        self.tuning = attention.tuning  # the grouped path's sizes (the backend's)
        self.row_invariant = attention.row_invariant
        self.cache_kwarg = cache_kwarg(self.layers[0]) if len(self.layers) else "cache"
        self.graphs = None  # SegmentGraphs once use_graphs() is called (CUDA graphs by shape bucket)
        self._passes: PassRunner | None = None  # how passes run on the machine (the backend's, made on first use)
        self._head_fast: nn.Module | None = None  # the reduced-vocabulary head's rows on a faster kernel
        self._projections_chosen = False

    def use_fast_projections(self) -> None:
        """Run this stack's projections on the kernels its backend chooses (on the CPU: packed weights where that
        measured faster for their shape). The layers become copies that share every parameter, so the model's own
        forward is untouched. Once per stack."""
        if self._projections_chosen:
            return
        self._projections_chosen = True
        self.layers = nn.ModuleList(self.backend.projections(layer) for layer in self.layers)
        if self.vocab_ids is None:
            self.parts = dataclasses.replace(self.parts, head=self.backend.projections(self.parts.head))
        if self._head_rows is not None:  # a reduced-vocabulary head (the draft's rows of the LM head)
            self._head_fast = self.backend.weight_projection(self._head_rows)

    def kernels(self) -> dict:
        """The kernels this process chose for the stack (stats and /health): what the backend swapped in, and the
        attention path. Chosen when a model loads, so a process that loaded beside busy neighbours may have chosen
        differently from a quiet one."""
        chosen = self.backend.describe([*self.layers, self.parts.head, self._head_fast])
        if not self.grouped:
            return {**chosen, "attention": "sdpa-masked"}
        return {**chosen, "attention": ",".join(f"{case}:{'sdpa' if case in self.sdpa_cases else 'grouped'}"
                                                for case in ATTENTION_CASES)}

    def use_graphs(self, capture: bool | None = None) -> None:
        """Run segment calls padded to shape buckets, captured as CUDA graphs (default: on CUDA). `capture=False`
        runs the same padded forwards eagerly: how the CPU tests their exactness."""
        from .graphs import SegmentGraphs

        if self.row_invariant:  # graphs pad passes to shape buckets, and per-row attention sizes itself on the host
            return
        self.graphs = SegmentGraphs(self, self.device.type == "cuda" if capture is None else capture)

    @property
    def dtype(self) -> torch.dtype:
        return self.parts.head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.parts.head.weight.device

    def new_cache(self) -> SlotKVCache:
        return SlotKVCache(
            self.exit_layers[-1], self.parts.num_kv_heads, self.parts.head_dim, self.dtype, self.device
        )

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [n, s] -> hidden [n, s, h]."""
        return self.parts.embed(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Shared final norm and LM head: hidden [..., h] -> logits [..., V] (full vocabulary, always)."""
        return self.head_logits(self.parts.norm(hidden))

    def head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head alone, on normed hidden states (a reduced-vocabulary head: -inf outside its subset)."""
        with self.passes.run("head", normed.shape[:-1].numel()):
            return self._head_logits(normed)

    def _head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        if self.vocab_ids is None:
            # [tokens, h] goes in as [1, tokens, h]: AutoTP's sharded LM head slices a [batch, seq, h] input.
            return self.parts.head(normed[None])[0] if normed.dim() == 2 else self.parts.head(normed)
        if self._head_fast is not None and normed.dtype == self._head_rows.dtype:
            sub = self._head_fast(normed)
        else:
            sub = torch.nn.functional.linear(normed, self._head_rows.to(normed.dtype))
        full = sub.new_full((*sub.shape[:-1], self.parts.head.weight.shape[0]), float("-inf"))
        return full.index_copy_(-1, self.vocab_ids.to(sub.device), sub)

    def run_segment(
        self, seg: int, x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, cache: SlotKVCache,
        rope_positions: torch.Tensor | None = None, allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Push x: [n, s, h] written at slots `positions`: [n, s] of cache rows: [n] through one segment's layers.

        By default a token's slot is its position (RoPE) and it sees slots up to its own. Token trees pass the
        RoPE positions (prefix length + depth - 1) and `allowed`: [n, s, kv_len] bool (prefix + ancestors + self).
        """
        if self.graphs is not None:
            out = self.graphs.run(seg, x, rows, positions, cache, rope_positions, allowed)
            if out is not None:
                return out
        lengths = (positions[:, -1] + 1).tolist()  # a row's grid ends at its last (or last dummy) slot
        kv_len = max(lengths)
        runs = cache.select(rows, positions, kv_len, runs_ok=self.grouped)
        if allowed is not None:
            mask = additive_mask(allowed, x.dtype)
        elif self.grouped and positions.shape == (1, 1):
            mask = None  # one row's one query at its last slot sees every slot: nothing to mask
        else:
            mask = slot_mask(positions, kv_len, x.dtype)
        groups = None
        if self.grouped and (plan := plan_kv_groups(lengths, self.tuning.group_overhead_slots)) is not None:
            groups = [(torch.tensor(g, device=x.device), max(lengths[i] for i in g)) for g in plan]
        with self.passes.run(seg, positions.numel()):
            return self.run_layers(seg, x, mask, positions if rope_positions is None else rope_positions, cache,
                                   groups, runs)

    @property
    def passes(self) -> PassRunner:
        """The backend's runner for this stack's passes (on the CPU: each pass's thread count), made for the device
        the stack sits on when it first runs."""
        if self._passes is None:
            self._passes = self.backend.passes(self.device)
        return self._passes

    def run_layers(self, seg: int, x: torch.Tensor, mask: torch.Tensor | None, rope: torch.Tensor,
                   cache: SlotKVCache, kv_groups: list[tuple[torch.Tensor, int]] | None = None,
                   kv_runs: list[tuple[int, int, int, int]] | None = None) -> torch.Tensor:
        """One segment's layers over x with an additive mask [n, 1, s, kv_len] (None: causal) and RoPE positions,
        the cache already pointed at its rows and slots (eager calls and the graphs a SegmentGraphs captures share
        this); kv_groups: rows attending apart over their own slots (grouped attention only, `plan_kv_groups`);
        kv_runs: the cache hands K/V over the rows' covering range, and these runs map query rows to its rows
        (`SlotKVCache.select`)."""
        lo, hi = self.segments[seg]
        if not self.grouped:  # grouped attention broadcasts one mask over the heads
            mask = head_mask(mask, self.parts.num_heads)
        cos_sin = self.parts.rotary(x, position_ids=rope)
        extra = {self.cache_kwarg: cache}
        if kv_groups is not None:
            extra["kv_groups"] = kv_groups
        if kv_runs is not None:
            extra["kv_runs"] = kv_runs
        if self.sdpa_cases and attention_case(x.shape[0], x.shape[1]) in self.sdpa_cases:
            extra["sdpa"] = True
        if self.per_query is not None:
            extra["per_query"] = self.per_query
        if self.grouped:
            extra["tuning"] = self.tuning
        for layer in self.layers[lo:hi]:
            out = layer(x, attention_mask=mask, position_ids=rope, position_embeddings=cos_sin, **extra)
            x = out[0] if isinstance(out, tuple) else out
        return x
