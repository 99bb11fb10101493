"""The verifier: target logits for committed + draft tokens of many sequences in one batched forward."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Protocol

import torch
from torch import nn

from .cache import causal_allowed
from .kernels import STOCK, Kernels
from .mixed import fold_plan, piece_allowed, pieces
from .prefix_cache import PrefixCacheSpec
from .decoder import decoder_parts
from .logprobs import reduce_rows
from .lora import LoraBank
from .rows import (FREE_WIDTH, PREFILL_CHUNK, PendingTree, RowState, RowTable, cache_scope, length_groups,
                   pending_grid)
from .stack import LayerStack
from .tree import ancestor_mask, node_depths
from .types import ScoreRequest, ScoredPrompt


def widen(x: torch.Tensor) -> torch.Tensor:
    """Half-precision logits to float32 for sampling; float32/float64 stay as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class Verifier(Protocol):
    """The scorer role: target logits at the last `num_logits` positions of each request's tokens. A request with
    `prompt` set may be answered with a ScoredPrompt (its leading rows reduced where the logits are) or with full
    logits (the engine then reduces them itself)."""

    def score(self, requests: list[ScoreRequest]) -> list[torch.Tensor]: ...

    def release(self, seq_id: str) -> None: ...


class TargetVerifier:
    """Runs a Hugging Face causal LM's layers over a slot cache; per-sequence KV, rollback by prefix sync.

    Works unchanged on a model whose Linear layers DeepSpeed AutoTP has sharded: every rank calls `score` with the
    same requests and rank 0's logits are the answer. `kernels` (core/kernels.py): how its layers attend and project.
    """

    def __init__(self, model: nn.Module, share_prefixes: bool = True, prefill_chunk: int = PREFILL_CHUNK,
                 cuda_graphs: bool = True, kernels: Kernels = STOCK,
                 prefix_cache: PrefixCacheSpec | None = None, lora: LoraBank | None = None,
                 mix_prompts: bool = True) -> None:
        parts = decoder_parts(model)
        self.model = model
        self.stack = LayerStack(parts, [len(parts.layers)], kernels=kernels)
        # LoRA rows (core/lora.py) gather their adapter per row on every call: graphs would freeze one batch's slots.
        if cuda_graphs and self.stack.device.type == "cuda" and lora is None:
            self.stack.use_graphs()  # decode and verify forwards as CUDA graphs (core/graphs.py)
        self.stack.use_fast_projections()  # the backend's projections (on the CPU: packed weights where faster)
        self.lora = lora  # adapters served over this base, one per row (ScoreRequest.adapter)
        if lora is not None:
            self.stack.layers = lora.wrap(self.stack.layers)
        self.cache = self.stack.new_cache()
        self.table = RowTable(1, self.cache)
        self.table.use_prefix_cache(prefix_cache)  # finished sequences' KV kept for later prompts (prefix_cache.py)
        self.vocab_size = model.config.vocab_size
        self.share_prefixes = share_prefixes
        self.prefill_chunk = prefill_chunk  # 0: every row's positions in one pass
        self.mix_prompts = mix_prompts  # prompt chunks fold into the decode rows' forward (core/mixed.py)

    @torch.no_grad()
    def score(self, requests: list[ScoreRequest]) -> list[torch.Tensor]:
        """One forward over every request's uncached positions; returns logits [num_logits, V] per request (a
        ScoredPrompt for a request with `prompt`: its prompt rows reduced here, in blocks, never shipped whole).

        Chains and token trees batch together: a tree's nodes take the slots after the prefix in their stored order,
        with RoPE positions by depth and a mask of prefix + ancestors (the accepted path is compacted on the next
        call, see RowTable).
        """
        if not requests:
            return []
        for req in requests:
            if req.num_logits < 1 or req.num_logits > len(req.tokens):
                raise ValueError(f"num_logits must be in [1, {len(req.tokens)}], got {req.num_logits}")
            if req.parents is not None and req.num_logits != len(req.parents) + 1:
                raise ValueError(f"a tree of {len(req.parents)} nodes needs {len(req.parents) + 1} logits")
            if req.prompt is not None and (req.parents is not None or not 0 <= req.prompt.rows < req.num_logits):
                raise ValueError(f"prompt rows must be in [0, {req.num_logits - 1}] of a chain, got {req.prompt.rows}")
        keys = self._adapter_keys(requests)
        states, starts, ends = [], [], []
        for req, st, key in zip(requests, self.table.sync_batch([(r.seq_id, r.tokens) for r in requests]), keys):
            if st.adapter != key:  # KV of another adapter (or of an earlier registration of this one) is not this row's
                st.adapter, st.filled = key, [0] * len(st.filled)
            # Positions whose logits are wanted must be recomputed even if their KV is cached.
            st.filled[0] = min(st.filled[0], len(req.tokens) - req.num_logits)
            states.append(st)
            starts.append(st.filled[0])
            ends.append(len(req.tokens) - 1)
        picked: list[torch.Tensor | None] = [None] * len(requests)
        batches = fork_order(requests, starts) if self.share_prefixes else [list(range(len(requests)))]
        for batch in batches:  # rows sharing a new prompt: after it is computed
            new = [i for i in batch if starts[i] == 0] if self.share_prefixes else []
            holders = self.table.holders() if new else []
            for i in new:
                same = [h for h in holders if h.adapter == keys[i]] if self.lora is not None else holders
                starts[i] = self.table.fork_counted(requests[i].seq_id,
                                                    len(requests[i].tokens) - requests[i].num_logits, same)
            for group, hidden in self._forwards(batch, requests, states, starts, ends):
                for h, i in zip(hidden, group):
                    picked[i] = h[len(h) - requests[i].num_logits :]
                    _computed(states[i], requests[i])
        prompts = {i: reduce_prompt(self.stack.logits, req, picked[i]) for i, req in enumerate(requests) if req.prompt}
        own = [h[req.prompt.rows:] if req.prompt else h for req, h in zip(requests, picked)]
        logits = widen(self.stack.logits(torch.cat(own)))  # one LM-head matmul for the whole batch
        out: list = list(logits.split([len(h) for h in own]))
        for i, (chosen, ids, values) in prompts.items():
            out[i] = ScoredPrompt(chosen, ids, values, out[i])
        return out

    def _adapter_keys(self, requests: list[ScoreRequest]) -> list[str]:
        """Each row's KV key (LoraBank.key); a row naming an adapter this verifier does not hold is refused."""
        if self.lora is None:
            named = sorted({r.adapter for r in requests if r.adapter})
            if named:
                raise ValueError(f"adapter(s) {named} asked of a verifier that serves no adapters")
            return [""] * len(requests)
        try:
            return [self.lora.key(r.adapter) for r in requests]
        except KeyError as exc:
            raise ValueError(f"adapter {exc.args[0]!r} is not loaded on this target") from None

    def _forwards(self, batch: list[int], requests: list[ScoreRequest], states: list, starts: list[int],
                  ends: list[int]):
        """Yield (request indices, hidden states per row) per forward of one batch: decode rows and the prompt chunks
        that fold into their forward together (core/mixed.py), every other prompt apart (`length_groups`)."""
        counts = [ends[i] - starts[i] + 1 for i in batch]
        plan = None
        if self.mix_prompts and self.prefill_chunk:  # prefill_chunk 0: every row's positions in one pass
            plan = fold_plan(counts, [requests[i].parents is None and c <= self.prefill_chunk
                                      for i, c in zip(batch, counts)])
        if plan is not None:
            width, folded, rest = plan
            apart = set(rest)
            mixed = [j for j in range(len(batch)) if j not in apart]
            group = [batch[j] for j in mixed]
            yield group, self._forward_mixed([requests[i] for i in group], [states[i] for i in group],
                                             [starts[i] for i in group], [ends[i] for i in group],
                                             [mixed.index(j) for j in folded], width)
            batch, counts = [batch[j] for j in rest], [counts[j] for j in rest]
        for sub_group in length_groups(counts):  # prompts apart from decode rows
            group = [batch[j] for j in sub_group]
            yield group, self._forward_chunked([requests[i] for i in group], [states[i] for i in group],
                                               [starts[i] for i in group], [ends[i] for i in group])

    def _forward_mixed(self, requests: list[ScoreRequest], states: list, starts: list[int], ends: list[int],
                       folded: list[int], width: int) -> list[torch.Tensor]:
        """One forward over whole rows and the `folded` rows cut into pieces of `width` positions, each piece a grid
        row over its sequence's cache row (core/mixed.py); hidden states [positions, h] per request."""
        grid = pieces(starts, ends, folded, width)
        views = [requests[p.index] for p in grid]
        hidden = self._forward(views, [states[p.index] for p in grid], [p.start for p in grid],
                               [p.end for p in grid], mixed=True)
        parts: list[list[torch.Tensor]] = [[] for _ in requests]
        for j, p in enumerate(grid):
            parts[p.index].append(hidden[j, : p.end - p.start + 1])
        return [x[0] if len(x) == 1 else torch.cat(x) for x in parts]

    def _forward_chunked(self, requests: list[ScoreRequest], states: list, starts: list[int],
                         ends: list[int]) -> list[torch.Tensor]:
        """Hidden states [positions, h] per row; a row with more than `prefill_chunk` positions runs its leading
        positions in passes of at most that many (plain causal, KV only), then a last pass with the rest (a tree's
        nodes always in the last). Attention over a long prompt in one pass builds [heads, n, n] scores that fall out
        of cache, while the matmuls are the same either way. It is also what bounds the positions a prompt adds to a
        round."""
        chunk, starts = self.prefill_chunk, list(starts)
        parts: list[list[torch.Tensor]] = [[] for _ in requests]
        while chunk:
            last = [_last_pass_start(r, s, e, chunk) for r, s, e in zip(requests, starts, ends)]
            lead = [i for i in range(len(requests)) if last[i] > starts[i]]
            if not lead:
                break
            cut = [min(starts[i] + chunk, last[i]) - 1 for i in lead]
            views = [replace(requests[i], tokens=requests[i].tokens[: c + 1], parents=None) for i, c in zip(lead, cut)]
            hidden = self._forward(views, [states[i] for i in lead], [starts[i] for i in lead], cut)
            for j, (i, c) in enumerate(zip(lead, cut)):
                if c > ends[i] - requests[i].num_logits:  # prompt logprobs: some of these positions are wanted
                    parts[i].append(hidden[j, : c - starts[i] + 1])
                starts[i] = c + 1
        hidden = self._forward(requests, states, starts, ends)
        for j in range(len(requests)):
            parts[j].append(hidden[j, : ends[j] - starts[j] + 1])
        return [p[0] if len(p) == 1 else torch.cat(p) for p in parts]

    def _forward(self, requests: list[ScoreRequest], states: list, starts: list[int], ends: list[int],
                 mixed: bool = False) -> torch.Tensor:
        """One padded forward over these rows' positions start..end; hidden states [rows, width, h].

        The rows run sorted by cache row: a batch holding rows r..r+n-1 then attends over a view of the cache instead
        of a gathered copy of every layer's K/V (SlotKVCache.select)."""
        order = sorted(range(len(requests)), key=lambda i: states[i].row)
        if order != list(range(len(requests))):
            hidden = self._forward_sorted([requests[i] for i in order], [states[i] for i in order],
                                          [starts[i] for i in order], [ends[i] for i in order], mixed)
            return hidden[torch.tensor(order).argsort().to(hidden.device)]
        return self._forward_sorted(requests, states, starts, ends, mixed)

    def _forward_sorted(self, requests: list[ScoreRequest], states: list, starts: list[int],
                        ends: list[int], mixed: bool = False) -> torch.Tensor:
        device = self.stack.device
        positions, _ = pending_grid(starts, ends, device)
        ids = torch.zeros(positions.shape, dtype=torch.long, device=device)
        for i, req in enumerate(requests):
            ids[i, : ends[i] - starts[i] + 1] = torch.tensor(req.tokens[starts[i] : ends[i] + 1], device=device)
        rows = torch.tensor([st.row for st in states], device=device)
        rope, allowed = tree_layout(requests, starts, positions)
        if mixed and allowed is None:  # pieces of one row share its cache row: each query sees up to its own slot
            allowed = piece_allowed(positions, int(positions.max()) + 1)
        if self.lora is None:
            return self.stack.run_segment(0, self.stack.embed(ids), rows, positions, self.cache, rope, allowed)
        self.lora.bind([r.adapter for r in requests], device)
        try:
            return self.stack.run_segment(0, self.stack.embed(ids), rows, positions, self.cache, rope, allowed)
        finally:
            self.lora.unbind()

    def prefix_cache_stats(self) -> dict:
        """`prefix_cache_queries` / `prefix_cache_hits` (tokens, vLLM's names) and the positions held now."""
        return self.table.prefix_cache.stats() if self.table.prefix_cache is not None else {}

    def release(self, seq_id: str) -> None:
        self.table.release(seq_id)

    @property
    def num_active(self) -> int:
        return len(self.table)


def reduce_prompt(head: Callable[[torch.Tensor], torch.Tensor], req: ScoreRequest, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A request's prompt rows (`req.prompt`) reduced to logprobs on this verifier, from its picked hidden states
    [num_logits, h] (row j at position len(tokens) - num_logits + j scores the token after it)."""
    first = len(req.tokens) - req.num_logits + 1
    rows = req.prompt.rows
    return reduce_rows(lambda h: widen(head(h)), hidden[:rows], req.tokens[first : first + rows], req.prompt.params,
                       req.prompt.top_n)


def _last_pass_start(req: ScoreRequest, start: int, end: int, chunk: int) -> int:
    """First position of a row's last pass: at most `chunk` positions, but every tree node in it."""
    first = max(start, end + 1 - chunk)
    return min(first, len(req.tokens) - len(req.parents)) if req.parents else first


def _computed(st: RowState, req: ScoreRequest) -> None:
    """A row's KV now holds its tokens (a tree's nodes: pending, compacted on the next sync)."""
    if req.parents:
        start = len(req.tokens) - len(req.parents)
        st.filled[0], st.tokens = start, st.tokens[:start]
        st.tree = PendingTree(start, list(req.tokens[start:]), list(req.parents))
    else:
        st.filled[0] = len(req.tokens)


def fork_order(requests: list[ScoreRequest], starts: list[int], min_shared: int = FREE_WIDTH) -> list[list[int]]:
    """Request indices in two forwards: a new row whose prompt shares at least `min_shared` positions with another
    new row of this call (the n choices of one request) waits for the second forward and forks that row's KV.

    The wait costs one more forward, so shorter shared prefixes are computed twice instead."""
    first, later = [], []
    heads: set[tuple] = set()  # scope and first min_shared tokens of the new rows in `first`
    for i, req in enumerate(requests):
        limit = len(req.tokens) - req.num_logits
        head = (cache_scope(req.seq_id), *req.tokens[:min_shared])  # rows of other scopes never fork this one
        # Sharing >= min_shared positions (within limit >= min_shared) is having the same first min_shared tokens.
        shares = starts[i] == 0 and limit >= min_shared and head in heads
        (later if shares else first).append(i)
        if not shares and starts[i] == 0 and len(head) == min_shared + 1:
            heads.add(head)
    return [first, later] if later else [first]


def tree_layout(
    requests: list[ScoreRequest], starts: list[int], positions: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """RoPE positions and attention of a batch that holds token trees (None, None when none does).

    Node i of a tree after a prefix of P tokens sits at slot P + i, has RoPE position P - 1 + depth(i), and sees the
    prefix, its ancestors and itself; every other token keeps slot = position and causal attention.
    """
    if not any(r.parents for r in requests):
        return None, None
    kv_len = int(positions.max()) + 1
    rope = positions.clone()
    allowed = causal_allowed(positions, kv_len)
    for i, (req, start) in enumerate(zip(requests, starts)):
        if not req.parents:
            continue
        n = len(req.parents)
        prefix = len(req.tokens) - n
        col = prefix - start  # grid column of node 0
        rope[i, col : col + n] = prefix - 1 + torch.tensor(node_depths(req.parents), device=positions.device)
        allowed[i, col : col + n, prefix : prefix + n] = ancestor_mask(req.parents).to(positions.device)
    return rope, allowed
