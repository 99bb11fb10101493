"""A decoder-only LM as embedding -> layers split at exits -> shared norm + LM head, run over rows of a slot cache.

Both the target (one exit, after its last layer) and the sorted draft (several exits) are a `LayerStack`: they call the
Hugging Face decoder layers directly, so any Llama-like family works, and the positions of every call are explicit.
`RowTable` maps sequence ids to cache rows and keeps, per segment, how many positions hold KV; syncing a row with the
token prefix a caller sends cuts those counts back to the common prefix, which is the whole KV rollback.
"""

from __future__ import annotations

import contextlib

import dataclasses
import inspect
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from .attention import plan_kv_groups
from .cache import SlotKVCache, additive_mask, head_mask, slot_mask
from .errors import CapacityError, ModelLoadError
from .kernels import ATTENTION_CASES, STOCK, AttentionShape, Kernels, attention_case
from .prefix_cache import PrefixCacheSpec, RetiredRows
from .threads import AdaptiveThreads, intra_op_threads, pass_threads, size_bucket

logger = logging.getLogger(__name__)


@dataclass
class DecoderParts:
    """The pieces of a Hugging Face causal LM that speculation needs; the seam for other model families."""

    embed: nn.Module
    layers: nn.ModuleList
    rotary: nn.Module
    norm: nn.Module
    head: nn.Module
    num_kv_heads: int
    head_dim: int
    num_heads: int


def cache_kwarg(layer: nn.Module) -> str:
    """The name a decoder layer takes its KV cache by: `cache` in newer transformers, `past_key_values` in older ones.
    A wrong name is silently swallowed by **kwargs and the layer attends to no cache."""
    params = inspect.signature(layer.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _llama_like_parts(model: nn.Module) -> DecoderParts:
    cfg = model.config
    base = model.model
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    # Head counts from the projection weights, not the config: under tensor parallelism (DeepSpeed AutoTP) each
    # rank holds only its share of the heads, and its KV cache and masks must be sized for that share.
    attn = base.layers[0].self_attn
    return DecoderParts(
        embed=base.embed_tokens,
        layers=base.layers,
        rotary=base.rotary_emb,
        norm=base.norm,
        head=model.lm_head,
        num_kv_heads=attn.k_proj.weight.shape[0] // head_dim,
        head_dim=head_dim,
        num_heads=attn.q_proj.weight.shape[0] // head_dim,
    )


# Families whose decoder layer takes (hidden, attention_mask, position_ids, cache, position_embeddings).
FAMILY_PARTS: dict[str, Callable[[nn.Module], DecoderParts]] = {
    "llama": _llama_like_parts,
    "mistral": _llama_like_parts,
    "qwen2": _llama_like_parts,
    "qwen3": _llama_like_parts,
}


def decoder_parts(model: nn.Module) -> DecoderParts:
    """Split a causal LM into parts; raise a clear error for families without a layer-level seam yet."""
    model_type = getattr(model.config, "model_type", "?")
    if model_type not in FAMILY_PARTS:
        raise ModelLoadError(
            f"model family '{model_type}' is not supported for speculation yet; supported: {sorted(FAMILY_PARTS)}"
        )
    if getattr(model.config, "sliding_window", None) and getattr(model.config, "use_sliding_window", True):
        logger.warning("sliding-window attention is ignored: contexts must stay within the window")
    return FAMILY_PARTS[model_type](model)


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
        self.row_invariant = attention.row_invariant  # each query row alone, as a decode step computes it
        self.cache_kwarg = cache_kwarg(self.layers[0]) if len(self.layers) else "cache"
        self.graphs = None  # SegmentGraphs once use_graphs() is called (CUDA graphs by shape bucket)
        self.wide_threads: int | None = None  # intra-op threads for wide passes (core/threads.py); None: as is
        self.threads: AdaptiveThreads | None = None  # each pass's thread count from its measured times (CPU)
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
        with self.pass_threads(("head", size_bucket(normed.shape[:-1].numel())), None):
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
        if self.grouped and (plan := plan_kv_groups(lengths)) is not None:
            groups = [(torch.tensor(g, device=x.device), max(lengths[i] for i in g)) for g in plan]
        most = pass_threads(self.wide_threads, positions.numel())
        with self.pass_threads((seg, size_bucket(positions.numel())), most):
            return self.run_layers(seg, x, mask, positions if rope_positions is None else rope_positions, cache,
                                   groups, runs)

    def pass_threads(self, key: tuple, most: int | None) -> contextlib.AbstractContextManager:
        """The block on `most` threads (None: the thread's own count), or on the count `threads` measured fastest
        for passes of kind `key`."""
        return intra_op_threads(most) if self.threads is None else self.threads.run(key, most)

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
        if self.row_invariant:
            extra["row_invariant"] = True
        for layer in self.layers[lo:hi]:
            out = layer(x, attention_mask=mask, position_ids=rope, position_embeddings=cos_sin, **extra)
            x = out[0] if isinstance(out, tuple) else out
        return x


@dataclass
class PendingTree:
    """KV of a verified token tree: node i sits at slot `start + i`, not yet at the slot of its depth."""

    start: int
    tokens: list[int]
    parents: list[int]

    def path(self, tokens: list[int]) -> list[int]:
        """Nodes along `tokens[start:]` from the root down (the accepted path, as the caller's tokens now say)."""
        out, node = [], -1
        for tok in tokens[self.start:]:
            nxt = next((i for i, (p, t) in enumerate(zip(self.parents, self.tokens)) if p == node and t == tok), None)
            if nxt is None:
                break
            out.append(nxt)
            node = nxt
        return out


def cache_scope(seq_id: str) -> str:
    """The cache scope a seq id names: `<scope>:<id>` forks only from rows of the same scope (the server puts the
    tenant and its `cache_salt` there, so one tenant's prompts never seed another's KV); an id without ':' is in the
    shared scope ""."""
    return seq_id.rpartition(":")[0]


@dataclass
class RowState:
    """One sequence's place in a cache: its row, the tokens it was synced to, KV fill per segment, its scope."""

    row: int
    tokens: list[int] = field(default_factory=list)
    filled: list[int] = field(default_factory=list)  # per segment: positions [0, filled) hold KV
    tree: PendingTree | None = None  # the last verified tree, compacted on the next sync
    scope: str = ""  # cache_scope of its seq id: forks read only rows of the same scope

    def held_prefix(self, tokens: list[int]) -> int:
        """How many leading positions of `tokens` this row holds KV for (first segment)."""
        return min(self.filled[0], common_prefix(self.tokens, tokens)) if self.filled else 0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] holds, a[:hi] == b[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class RowTable:
    """seq_id -> RowState with a free list; sync() is the KV rollback (cut fill back to the common token prefix).

    With `max_rows` set (set_limits) the table never holds more sequences than that: a new sequence takes the row of
    the least recently synced one (a sequence that finished elsewhere, moved to another replica, or idles). The
    evicted sequence loses only time: its next call finds no state and recomputes from its token prefix.
    """

    def __init__(self, num_segments: int, cache: SlotKVCache) -> None:
        self.num_segments = num_segments
        self.cache = cache
        self.states: OrderedDict[str, RowState] = OrderedDict()  # least recently synced first
        self.max_rows: int | None = None
        self.num_evicted = 0  # sequences whose row was taken for another (their KV is recomputed if they return)
        self.num_forked_tokens = 0  # prompt positions copied from another row instead of computed (fork)
        self.prefix_cache: RetiredRows | None = None  # finished rows kept for forks (use_prefix_cache)
        self.forked_stores: list = []  # per-row stores a fork copies with the KV (a drafter's HiddenStore)
        self._free: list[int] = []
        self._next_row = 0

    def set_limits(self, max_rows: int | None, max_slots: int | None = None) -> None:
        """Bound this table's rows and its cache's growth (call before use; memory <= max_rows x max_slots)."""
        self.max_rows = max_rows
        self.cache.max_rows, self.cache.max_slots = max_rows, max_slots

    def use_prefix_cache(self, spec: PrefixCacheSpec | None) -> None:
        """Keep finished sequences' rows for later forks, up to spec.max_tokens positions (None: clear on release)."""
        self.prefix_cache = RetiredRows(spec) if spec is not None else None

    def sync_batch(self, items: list[tuple[str, list[int]]]) -> list[RowState]:
        """sync() every (seq_id, tokens) of one forward; none of them can evict another. More distinct sequences than
        max_rows in one forward is refused (CapacityError) before any state changes: callers split such batches."""
        distinct = {seq_id for seq_id, _ in items}
        if self.max_rows is not None and len(distinct) > self.max_rows:
            raise CapacityError(f"{len(distinct)} sequences in one forward; this replica holds at most "
                                f"{self.max_rows} (split the batch or raise max_live_sequences)")
        for seq_id in distinct & self.states.keys():
            self.states.move_to_end(seq_id)  # protect the batch's own rows from eviction below
        return [self.sync(seq_id, tokens) for seq_id, tokens in items]

    def sync(self, seq_id: str, tokens: list[int]) -> RowState:
        state = self.states.get(seq_id)
        if state is None:
            state = RowState(row=self._take_row(), filled=[0] * self.num_segments, scope=cache_scope(seq_id))
            self.states[seq_id] = state
        else:
            self.states.move_to_end(seq_id)
            if state.tree is not None:
                self._commit_tree(state, tokens)
            keep = common_prefix(state.tokens, tokens)
            if keep < min(state.filled, default=0):
                logger.debug("seq %s: prefix mismatch at %d, recomputing from there", seq_id, keep)
            state.filled = [min(f, keep) for f in state.filled]
        state.tokens = list(tokens)
        return state

    def _commit_tree(self, state: RowState, tokens: list[int]) -> None:
        """Keep only the accepted path of the last tree: move its KV to consecutive slots after the prefix (one
        gather per layer); rejected nodes are left behind to be overwritten. Afterwards rollback is a length again."""
        tree, state.tree = state.tree, None
        path = tree.path(tokens)
        if not path:
            return
        src = [tree.start + i for i in path]
        if src != list(range(tree.start, tree.start + len(path))):
            self.cache.move_slots(state.row, src, tree.start)
        state.tokens = state.tokens[: tree.start] + [tree.tokens[i] for i in path]
        state.filled = [tree.start + len(path) if f >= tree.start else f for f in state.filled]

    def holders(self) -> list[RowState]:
        """The rows holding KV: where `fork` looks (taken once for a batch of forks, not once per fork: a forked row
        holds a prefix of its source, never more). Finished rows the prefix cache keeps come first."""
        kept = self.prefix_cache.states() if self.prefix_cache is not None else []
        return kept + [state for state in self.states.values() if state.filled and state.filled[0] > 0]

    def fork(self, seq_id: str, limit: int, among: list[RowState] | None = None) -> int:
        """Give a sequence with no KV yet the longest prefix of its tokens that another live row of its scope holds
        (of `among`, default every row), at most `limit` positions: one copy per layer instead of a prefill (n choices
        of one prompt, a shared system prompt). Returns the positions it now holds (0: nothing shared)."""
        state = self.states[seq_id]
        if any(state.filled):
            return 0
        src, shared = None, 0
        for other in self.states.values() if among is None else among:  # fewer positions than found cannot do better
            if other is state or not other.filled or other.filled[0] <= shared or other.scope != state.scope:
                continue
            n = min(other.held_prefix(state.tokens), limit)
            if n > shared:
                src, shared = other, n
                if shared >= limit:  # n choices of one prompt: the first row that holds it ends the search
                    break
        if src is None:
            return 0
        for store in [self.cache, *self.forked_stores]:
            store.copy_prefix(src.row, state.row, shared)
        if self.prefix_cache is not None:
            self.prefix_cache.touch(src)
        state.filled = [min(f, shared) for f in src.filled]
        self.num_forked_tokens += state.filled[0]
        return state.filled[0]

    def fork_counted(self, seq_id: str, limit: int, among: list[RowState]) -> int:
        """`fork` for a new sequence, counted in the prefix cache's queries (`limit` positions) and hits."""
        forked = self.fork(seq_id, limit, among=among) if among else 0
        if self.prefix_cache is not None:
            self.prefix_cache.queries += max(limit, 0)
            self.prefix_cache.hits += forked
        return forked

    def cached_prefix(self, seq_id: str, tokens: list[int]) -> int:
        """How many leading positions of `tokens` already hold KV here in the first segment (0 for an unknown id)."""
        state = self.states.get(seq_id)
        return 0 if state is None else state.held_prefix(tokens)

    def _take_row(self) -> int:
        if self._free:
            return self._free.pop()
        if self.max_rows is None or self._next_row < self.max_rows:
            self._next_row += 1
            return self._next_row - 1
        kept = self.prefix_cache.take() if self.prefix_cache is not None else None
        if kept is not None:  # a finished sequence's cached prefix gives way before a live sequence does
            return kept
        seq_id, state = next(iter(self.states.items()))  # least recently synced
        logger.debug("row %d: evicting seq %s (table full at %d rows)", state.row, seq_id, self.max_rows)
        del self.states[seq_id]
        self.num_evicted += 1
        return state.row  # stale KV in it is never read: the new sequence's fill starts at 0

    def release(self, seq_id: str) -> None:
        state = self.states.pop(seq_id, None)
        if state is None:
            return
        freed = [state.row] if self.prefix_cache is None else self.prefix_cache.retire(state, self.cache.num_slots)
        for row in freed:
            self.cache.clear_row(row)
            self._free.append(row)

    def __len__(self) -> int:
        return len(self.states)


def limit_rows(holder, max_rows: int | None, max_slots: int | None = None) -> None:
    """Bound a drafter's or verifier's per-sequence memory: its RowTable and cache, and a drafter's HiddenStore."""
    holder.table.set_limits(max_rows, max_slots)
    hidden = getattr(holder, "hidden", None)
    if hidden is not None:
        hidden.max_rows, hidden.max_slots = max_rows, max_slots


# Positions per pass over a long prompt (verifier and draft): attention over n positions at once builds [heads, n, n]
# scores that fall out of cache, so a long prompt runs faster in passes of a few hundred positions.
PREFILL_CHUNK = 256
FREE_WIDTH = 32  # padding a row by this many positions costs about what one more forward's fixed overhead does


def length_groups(counts: list[int], free_width: int = FREE_WIDTH) -> list[list[int]]:
    """Split rows with `counts` pending positions into forwards that waste little on padding.

    A forward pads every row to its longest, so one 1000-token prompt batched with seven decode rows would compute
    8000 positions instead of about 1000: that made served throughput FALL with concurrency. Rows are taken longest
    first and a row joins the current forward while padding it costs at most `free_width` positions, so decode rows
    (chains, trees) share one forward and each prompt of another length gets its own. Returns row indices per
    forward, each list in the rows' original order.
    """
    order = sorted(range(len(counts)), key=lambda i: -counts[i])
    groups: list[list[int]] = []
    width = 0
    for i in order:
        if groups and width - counts[i] <= free_width:
            groups[-1].append(i)
        else:
            groups.append([i])
            width = counts[i]
    return [sorted(g) for g in groups]


def pending_grid(starts: list[int], ends: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions start..end (inclusive) per row, padded on the right past `end` with dummy positions.

    Returns positions: [n, s] and valid: [n, s]. Dummy positions write only to slots after the row's last token,
    which are rewritten before any real query can attend to them.
    """
    counts = [e - s + 1 for s, e in zip(starts, ends)]
    width = max(counts)
    offs = torch.arange(width, device=device)
    start_t = torch.tensor(starts, device=device)[:, None]
    count_t = torch.tensor(counts, device=device)[:, None]
    return start_t + offs, offs < count_t
