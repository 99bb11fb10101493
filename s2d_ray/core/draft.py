"""The sorted (nested) draft: the first L layers of a family model with exits sharing the final norm and LM head.

Each draft token leaves at the shallowest exit whose confidence (max softmax) exceeds that exit's threshold tau; the
last exit always emits. A token that left early has no KV in deeper layers: its hidden state at the exit is kept, and
the next token that goes deeper first pushes those kept states through the missing layers (lazy KV fill).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
from torch import nn

from .cache import HiddenStore, SlotKVCache
from .errors import ModelLoadError, RequestError
from .frontier import DraftTree, commit_path, expand_frontier
from .kernels import STOCK, Kernels
from .prefix_cache import PrefixCacheSpec
from .sampling import logits_to_probs, round_generator, sample
from .decoder import DecoderParts, decoder_parts
from .rows import PREFILL_CHUNK, RowState, RowTable, length_groups, pending_grid
from .stack import LayerStack
from .types import DraftRequest, Proposal

logger = logging.getLogger(__name__)


class Drafter(Protocol):
    """The proposer role: up to k draft tokens per sequence, with the q they were drawn from."""

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]: ...

    def release(self, seq_id: str) -> None: ...


@dataclass
class DraftSpec:
    """What a draft directory records besides weights: where its layers came from and how it exits."""

    base_model: str  # source of the shared embedding/norm/head (and of untrained layers)
    num_layers: int
    exit_layers: list[int]
    thresholds: list[float]  # one tau per exit; the last exit always emits
    trained_norm_head: bool = False  # True when the draft's own norm/head are stored (not the base's)
    reduced_vocab: int | None = None  # size of the draft head's token subset (ids stored with the weights)
    provenance: dict = field(default_factory=dict)

    def validate(self) -> None:
        ex = self.exit_layers
        if not ex or any(b <= a for a, b in zip(ex, ex[1:])) or ex[0] < 1 or ex[-1] > self.num_layers:
            raise ModelLoadError(f"exit_layers must increase within 1..{self.num_layers}, got {ex}")
        if len(self.thresholds) != len(ex):
            raise ModelLoadError(f"need one threshold per exit ({len(ex)}), got {len(self.thresholds)}")


class SortedDraft(nn.Module):
    """A nested multi-exit draft. `layers` are its own (trained) or the base's first L (a cut, untrained draft);
    `kernels` (core/kernels.py): how its layer stack attends and projects. Saved and loaded by models/drafts.py."""

    def __init__(self, parts: DecoderParts, spec: DraftSpec, layers: nn.ModuleList | None = None,
                 vocab_ids: torch.Tensor | None = None, kernels: Kernels = STOCK) -> None:
        super().__init__()
        spec.validate()
        if vocab_ids is not None:  # a copy: the caller's spec (maybe another draft's) stays as it was
            spec = replace(spec, reduced_vocab=int(vocab_ids.numel()))
        self.spec = spec
        if layers is None:
            layers = nn.ModuleList(list(parts.layers)[: spec.num_layers])
        self.layers = layers
        # The base's parts with the draft's own layers: the base's other layers stay unreferenced, so a draft loaded
        # on a base of its own (the draft deployment) holds the embedding, norm, head and its L layers, not the
        # whole base model (for a large family, most of its weights, in layers the draft never runs).
        self.parts = replace(parts, layers=layers)
        self.vocab_ids = vocab_ids
        self.kernels = kernels
        self.stack = LayerStack(self.parts, spec.exit_layers, layers=self.layers, vocab_ids=vocab_ids, kernels=kernels)

    @classmethod
    def cut(cls, base_model: nn.Module, base_source: str, num_layers: int, exit_layers: list[int] | None = None,
            thresholds: list[float] | None = None, copy_layers: bool = False, kernels: Kernels = STOCK
            ) -> "SortedDraft":
        """An untrained draft from the base's first `num_layers` layers (shared, or copied for training)."""
        parts = decoder_parts(base_model)
        exit_layers = exit_layers or default_exits(num_layers)
        thresholds = thresholds if thresholds is not None else paper_thresholds(len(exit_layers))
        layers = nn.ModuleList(copy.deepcopy(list(parts.layers)[:num_layers])) if copy_layers else None
        spec = DraftSpec(base_source, num_layers, list(exit_layers), list(thresholds))
        return cls(parts, spec, layers, kernels=kernels)

    def with_exits(self, exit_layers: list[int], thresholds: list[float] | None = None) -> "SortedDraft":
        """The same weights with other exits (e.g. `exit:L` baselines use a single exit)."""
        thresholds = thresholds if thresholds is not None else paper_thresholds(len(exit_layers))
        spec = replace(self.spec, exit_layers=list(exit_layers), thresholds=list(thresholds),
                       provenance=dict(self.spec.provenance))
        return SortedDraft(self.parts, spec, self.layers, self.vocab_ids, self.kernels)

    def with_vocab(self, vocab_ids: torch.Tensor | None) -> "SortedDraft":
        """The same draft proposing only from `vocab_ids` (sorted token ids), or from the full vocabulary."""
        spec = replace(self.spec, reduced_vocab=None, provenance=dict(self.spec.provenance))
        ids = None if vocab_ids is None else torch.as_tensor(vocab_ids, dtype=torch.long).sort().values
        return SortedDraft(self.parts, spec, self.layers, ids, self.kernels)


def default_exits(num_layers: int) -> list[int]:
    """Three evenly spaced exits ending at the last layer (the paper's 6/9/12 of 12 pattern, as thirds)."""
    if num_layers < 3:
        return list(range(1, num_layers + 1))
    return sorted({max(1, round(num_layers * f)) for f in (1 / 3, 2 / 3)} | {num_layers})


def paper_thresholds(num_exits: int) -> list[float]:
    """The paper's default: 0.5 at every exit but the last, which always emits."""
    return [0.5] * (num_exits - 1) + [0.0]


@dataclass
class _StepOut:
    logits: torch.Tensor  # [n, V] at the emitting exit
    exits: list[int]


class SortedDrafter:
    """Proposes tokens with adaptive exits over a SortedDraft; batched over sequences, KV per sequence."""

    def __init__(self, draft: SortedDraft, stop_confidence: float = 0.0, prefill_chunk: int = PREFILL_CHUNK,
                 cuda_graphs: bool = True, prefix_cache: PrefixCacheSpec | None = None) -> None:
        self.draft = draft
        self.prefill_chunk = prefill_chunk  # 0: a prompt in one pass
        self.stack = draft.stack
        if cuda_graphs and self.stack.device.type == "cuda" and self.stack.graphs is None:
            self.stack.use_graphs()  # each segment's forwards as CUDA graphs (core/graphs.py)
        self.stack.use_fast_projections()  # the backend's projections (on the CPU: packed weights where faster)
        self.exit_layers = draft.spec.exit_layers
        self.thresholds = draft.spec.thresholds
        self.stop_confidence = stop_confidence  # stop drafting a sequence when its q(x) falls below this
        self.cache: SlotKVCache = self.stack.new_cache()
        self.table = RowTable(len(self.exit_layers), self.cache)
        self.table.use_prefix_cache(prefix_cache)  # finished sequences' KV kept for later prompts (prefix_cache.py)
        hidden = draft.parts.embed.weight.shape[1]
        self.hidden = HiddenStore(len(self.exit_layers) - 1, hidden, self.stack.dtype, self.stack.device)
        self.table.forked_stores.append(self.hidden)  # a fork copies the kept exit states with the KV
        self.trees: dict[str, tuple[RowState, DraftTree]] = {}  # the last frontier tree per sequence, until compacted

    @torch.no_grad()
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        """Chains (a token per depth, sampled from q when sampling) or trees (`req.tree`): with `frontier` 1 the
        argmax spine of depth k, each depth's next `width - 1` most probable tokens as sibling leaves; with more, the
        best `frontier` nodes of each depth expanded in one batched forward (core/frontier.py). Scores are path
        probabilities."""
        self._commit_trees(requests)
        states = self.table.sync_batch([(r.seq_id, r.tokens) for r in requests])
        for seq_id in [s for s, (st, _) in self.trees.items() if self.table.states.get(s) is not st]:
            del self.trees[seq_id]  # its row was evicted (the sequence went elsewhere): nothing left to compact
        for st in states:  # the last token is always re-run: its logits start the draft (a retried round sends the
            st.filled = [min(f, len(st.tokens) - 1) for f in st.filled]  # same tokens again, already all in KV)
        self._fork_new(states)
        props = [Proposal([], None, [], [], []) if r.tree else Proposal.empty() for r in requests]
        spine = [(-1, 1.0)] * len(requests)  # per request: (last spine node, its path probability)
        live = [i for i, r in enumerate(requests) if r.k > 0]
        roots: dict[int, tuple[torch.Tensor, int]] = {}  # frontier rows: the root's logits and exit
        for step in range(max((r.k for r in requests), default=0)):
            live = [i for i in live if requests[i].k > step]
            if not live:
                break
            out = self._step([states[i] for i in live], [self._thresholds(requests[i]) for i in live])
            still = []
            for j, i in enumerate(live):
                req, prop = requests[i], props[i]
                if req.tree and req.frontier > 1:  # the first step only: its depths run batched over the frontier
                    roots[i] = (out.logits[j], out.exits[j])
                    continue
                if req.tree:
                    tok = self._grow_tree(prop, out.logits[j], out.exits[j], req.width, spine, i)
                else:
                    probs = logits_to_probs(out.logits[j], req.params)
                    gen = round_generator(req.params.seed, len(states[i].tokens), "draft")
                    tok = int(probs.argmax()) if req.params.greedy else sample(probs, gen)
                    prop.tokens.append(tok)
                    prop.exits.append(out.exits[j])
                    if not req.params.greedy:
                        prop.q = probs[None] if prop.q is None else torch.cat([prop.q, probs[None]])
                states[i].tokens.append(tok)
                deeper = spine[i][1] >= req.min_score if req.tree else True
                if deeper and self._confident(out.logits[j], tok):
                    still.append(i)
            live = still
        if roots:
            rows = sorted(roots)
            trees = expand_frontier(self, [requests[i] for i in rows], [states[i] for i in rows],
                                    [roots[i] for i in rows], [props[i] for i in rows],
                                    [self._thresholds(requests[i]) for i in rows])
            for i, tree in zip(rows, trees):
                self.trees[requests[i].seq_id] = (states[i], tree)
        return props

    def _fork_new(self, states: list[RowState]) -> None:
        """With a prefix cache, a new sequence copies the longest prefix a cached or live row holds (KV and the kept
        exit states its deeper segments fill from) instead of drafting over its prompt again."""
        new = [st for st in states if not any(st.filled)] if self.table.prefix_cache is not None else []
        holders = self.table.holders() if new else []
        seq_ids = {id(st): seq_id for seq_id, st in self.table.states.items()}
        for st in new:
            self.table.fork_counted(seq_ids[id(st)], len(st.tokens) - 1, holders)

    def prefix_cache_stats(self) -> dict:
        """`prefix_cache_queries` / `prefix_cache_hits` (tokens, vLLM's names) and the positions held now."""
        return self.table.prefix_cache.stats() if self.table.prefix_cache is not None else {}

    def _commit_trees(self, requests: list[DraftRequest]) -> None:
        """Before syncing: compact each sequence's last frontier tree to the path its tokens now say was accepted
        (a row evicted or released since then is skipped: its state is new)."""
        for req in requests:
            pending = self.trees.pop(req.seq_id, None)
            if pending is not None and self.table.states.get(req.seq_id) is pending[0]:
                commit_path(pending[1], pending[0], req.tokens, self)

    @staticmethod
    def _grow_tree(prop: Proposal, logits: torch.Tensor, exit_layer: int, width: int, spine: list[tuple[int, float]],
                   i: int) -> int:
        """Add one depth below the spine's last node: its top-`width` tokens (the first continues the spine), each
        scored by the path probability; returns the spine token."""
        probs = torch.softmax(logits.float(), -1)
        top = torch.topk(probs, max(width, 1))
        parent, base = spine[i]
        toks, prs = top.indices.tolist(), top.values.tolist()
        first = len(prop.tokens)
        for tok, pr in zip(toks, prs):
            if pr <= 0.0:  # outside a reduced-vocabulary head
                break
            prop.tokens.append(tok)
            prop.parents.append(parent)
            prop.exits.append(exit_layer)
            prop.scores.append(base * pr)
        spine[i] = (first, base * prs[0])
        return toks[0]

    def _thresholds(self, req: DraftRequest) -> Sequence[float]:
        if req.thresholds is None:
            return self.thresholds
        if len(req.thresholds) != len(self.exit_layers):
            raise RequestError(f"need one threshold per exit ({len(self.exit_layers)}), got {len(req.thresholds)}")
        return req.thresholds

    def _confident(self, logits: torch.Tensor, tok: int) -> bool:
        if self.stop_confidence <= 0:
            return True
        return float(torch.softmax(logits.float(), -1)[tok]) >= self.stop_confidence

    def _step(self, states: list[RowState], thresholds: list[Sequence[float]]) -> _StepOut:
        """Advance each row by its last token: lazily fill, exit where confident (by the row's own thresholds);
        logits for the next token. Rows that still have a prompt to fill run apart from the decode rows."""
        self._fill_long(states)
        groups = length_groups([len(st.tokens) - min(st.filled) for st in states])
        if len(groups) == 1:
            return self._step_rows(states, thresholds)
        logits: list[torch.Tensor | None] = [None] * len(states)
        exits = [0] * len(states)
        for group in groups:
            out = self._step_rows([states[i] for i in group], [thresholds[i] for i in group])
            for j, i in enumerate(group):
                logits[i], exits[i] = out.logits[j], out.exits[j]
        return _StepOut(torch.stack(logits), exits)

    def _fill_long(self, states: list[RowState]) -> None:
        """Rows with more than `prefill_chunk` positions to fill first fill KV (every segment) in passes of that many,
        as the verifier does with a long prompt (TargetVerifier._forward_chunked); the step then runs the rest."""
        chunk = self.prefill_chunk
        every_segment = [2.0] * len(self.exit_layers)  # no exit is that confident: a pass fills all segments
        while chunk:
            long = [st for st in states if len(st.tokens) - 1 - max(st.filled) > chunk]
            if not long:
                return
            # views share `filled` with the rows, so the passes' progress is theirs
            views = [RowState(st.row, st.tokens[: max(st.filled) + chunk], st.filled) for st in long]
            for group in length_groups([len(v.tokens) - min(v.filled) for v in views]):
                self._step_rows([views[i] for i in group], [every_segment] * len(group))

    def _step_rows(self, states: list[RowState], thresholds: list[Sequence[float]]) -> _StepOut:
        """`_step` over rows of similar pending length: one padded forward per segment."""
        device = self.stack.device
        n = len(states)
        ends = [len(st.tokens) - 1 for st in states]
        self.hidden.reserve(max(st.row for st in states) + 1, max(ends) + 2 * len(self.stack.segments) + 8)
        logits_out: list[torch.Tensor | None] = [None] * n
        exits = [0] * n
        active = list(range(n))
        for seg, exit_layer in enumerate(self.exit_layers):
            sub = [states[a] for a in active]
            starts = [st.filled[seg] for st in sub]
            sub_ends = [ends[a] for a in active]
            positions, valid = pending_grid(starts, sub_ends, device)
            rows = torch.tensor([st.row for st in sub], device=device)
            x = self._segment_input(seg, sub, positions, valid)
            h = self.stack.run_segment(seg, x, rows, positions, self.cache)
            if seg < len(self.exit_layers) - 1:
                r_idx = rows[:, None].expand_as(positions)
                self.hidden.bufs[seg][r_idx[valid], positions[valid]] = h[valid]
            last = (valid.sum(1) - 1)
            h_last = h[torch.arange(len(sub), device=device), last]
            logits = self.stack.logits(h_last)
            for st, e in zip(sub, sub_ends):
                st.filled[seg] = e + 1
            final = seg == len(self.exit_layers) - 1
            conf = None if final else torch.softmax(logits.float(), -1).amax(-1)
            keep = []
            for j, a in enumerate(active):
                if final or float(conf[j]) > thresholds[a][seg]:
                    logits_out[a], exits[a] = logits[j], exit_layer
                else:
                    keep.append(a)
            active = keep
            if not active:
                break
        return _StepOut(torch.stack(logits_out), exits)

    def _segment_input(self, seg: int, sub: list[RowState], positions: torch.Tensor,
                       valid: torch.Tensor) -> torch.Tensor:
        """Segment 0 embeds tokens; deeper segments read kept hidden states of the previous exit. Dummies copy a real
        one."""
        device = self.stack.device
        clamped = torch.minimum(positions, (positions * valid).amax(1, keepdim=True))
        if seg == 0:
            ids = torch.tensor(
                [[st.tokens[p] for p in row] for st, row in zip(sub, clamped.tolist())], device=device
            )
            return self.stack.embed(ids)
        rows = torch.tensor([st.row for st in sub], device=device)
        return self.hidden.bufs[seg - 1][rows[:, None], clamped]

    def release(self, seq_id: str) -> None:
        self.trees.pop(seq_id, None)
        self.table.release(seq_id)

    @property
    def num_active(self) -> int:
        return len(self.table)
