"""Draft-side frontier expansion (EAGLE-2 dynamic trees): every depth, the most probable frontier nodes of every
sequence are expanded in ONE batched draft forward with tree attention.

A sequence's draft tree lives in the draft's own cache after its P committed tokens: node i at slot P + i, RoPE
position P - 1 + depth(i), attending to the committed prefix, its ancestors and itself (the target's tree layout,
core/target.py). A node's children are its top-`width` tokens, scored by the product of draft probabilities along the
path; the next depth expands the best `frontier` of the nodes just added (EAGLE-2's rule). Every candidate is
deterministic, so any such choice keeps acceptance exact (core/tree.py).

Adaptive exits per node: each frontier node leaves at the shallowest exit that is confident enough. A node going
deeper than one of its ancestors (or than the committed prefix) first pushes those through the missing layers, in
the same forward (lazy fill, as chains do), so at every segment a node's ancestors hold KV before it attends to them.

After verification only the accepted path survives: `commit_path` moves its KV and kept hidden states to consecutive
slots after the prefix and sets each segment's fill to the part of the path that segment computed, so rollback is
"lower a length" again (the target's `RowTable._commit_tree`, with per-segment fill).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .cache import HiddenStore, SlotKVCache, causal_allowed
from .rows import PendingTree, RowState, length_groups
from .stack import LayerStack
from .target import widen
from .tree import TokenTree, ancestor_mask
from .types import DraftRequest, Proposal


class FrontierDrafter(Protocol):
    """What frontier expansion uses of a drafter (core/draft.py's SortedDrafter): its layer stack and exits, its KV
    cache and kept hidden states, and the confidence below which a node is not expanded."""

    stack: LayerStack
    cache: SlotKVCache
    hidden: HiddenStore
    exit_layers: list[int]
    stop_confidence: float


@dataclass
class DraftTree:
    """One sequence's draft tree in the draft cache: node i at slot `start + i`; `filled[seg][i]`: node i holds KV
    (and its kept hidden state) at that segment."""

    start: int  # committed tokens P (the root is token P - 1)
    row: int
    num_segments: int
    nodes: TokenTree = field(default_factory=TokenTree)
    depths: list[int] = field(default_factory=list)
    filled: list[list[bool]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.filled = [[] for _ in range(self.num_segments)]

    def add(self, parent: int, token: int, exit_layer: int, score: float) -> int:
        i = len(self.nodes)
        self.nodes.tokens.append(token)
        self.nodes.parents.append(parent)
        self.nodes.exits.append(exit_layer)
        self.nodes.scores.append(score)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        for seg in self.filled:
            seg.append(False)
        return i

    def pending(self, seg: int, active: Sequence[int]) -> list[int]:
        """The active nodes plus every ancestor of theirs without KV at `seg`, in slot (topological) order. A filled
        node's ancestors are filled too (they were pending in the forward that computed it), so the walk stops there."""
        need: set[int] = set()
        for n in active:
            need.add(n)
            j = self.nodes.parents[n]
            while j >= 0 and j not in need and not self.filled[seg][j]:
                need.add(j)
                j = self.nodes.parents[j]
        return sorted(need)


def tree_grid(trees: list[DraftTree], firsts: list[int], nodes: list[list[int]], device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots, RoPE positions and attention of one forward: per row, the committed positions firsts[r]..P-1 still
    without KV at this segment, then tree nodes `nodes[r]` (topological order).

    Returns slots [n, s], rope [n, s], allowed [n, s, kv_len] (a committed position sees slots 0..itself; node i sees
    slots 0..P-1, P + each ancestor and P + i) and valid [n, s]. Padding queries sit past every node of their row (slots
    later nodes overwrite before anything reads them) and see only themselves.
    """
    counts = [t.start - f + len(ns) for t, f, ns in zip(trees, firsts, nodes)]
    width = max(counts)
    slots = torch.zeros(len(trees), width, dtype=torch.long)
    rope = torch.zeros_like(slots)
    valid = torch.zeros(len(trees), width, dtype=torch.bool)
    for r, (t, f, ns) in enumerate(zip(trees, firsts, nodes)):
        n_c = t.start - f
        slots[r, :n_c] = torch.arange(f, t.start)
        rope[r, :n_c] = slots[r, :n_c]
        if ns:
            slots[r, n_c : n_c + len(ns)] = t.start + torch.tensor(ns)
            rope[r, n_c : n_c + len(ns)] = t.start - 1 + torch.tensor([t.depths[i] for i in ns])
        pad = width - counts[r]
        slots[r, counts[r]:] = t.start + len(t.nodes) + torch.arange(pad)
        valid[r, : counts[r]] = True
    kv_len = int(slots.max()) + 1
    allowed = causal_allowed(slots, kv_len)
    for r, (t, f, ns) in enumerate(zip(trees, firsts, nodes)):
        n_c, n_t = t.start - f, len(t.nodes)
        if ns:
            q = slice(n_c, n_c + len(ns))
            allowed[r, q] = False
            allowed[r, q, : t.start] = True
            cols = min(n_t, kv_len - t.start)  # nodes past the last pending one are nobody's ancestors here
            allowed[r, q, t.start : t.start + cols] = ancestor_mask(t.nodes.parents)[ns][:, :cols]
        for c in range(counts[r], width):  # padding: itself only
            allowed[r, c] = False
            allowed[r, c, slots[r, c]] = True
    return slots.to(device), rope.to(device), allowed.to(device), valid.to(device)


def expand_frontier(drafter: FrontierDrafter, requests: list[DraftRequest], states: list[RowState],
                    roots: list[tuple[torch.Tensor, int]], props: list[Proposal],
                    thresholds: list[Sequence[float]]) -> list[DraftTree]:
    """Grow each request's tree from its root logits (already computed: the drafter's first step), one batched
    forward per further depth, and fill `props` with the nodes (topological order, scores = path probabilities).
    thresholds: per request, one tau per exit."""
    trees = [DraftTree(len(st.tokens), st.row, len(drafter.exit_layers)) for st in states]
    frontier = []  # per row: nodes to expand next, with the logits that chose them already known
    for req, tree, (logits, exit_layer) in zip(requests, trees, roots):
        added = _children(tree, -1, 1.0, logits, exit_layer, req.width)
        frontier.append(_select(tree, added, req, 1, drafter.stop_confidence))
    while any(frontier):
        live = [r for r, f in enumerate(frontier) if f]
        out = _frontier_step(drafter, [states[r] for r in live], [trees[r] for r in live], [frontier[r] for r in live],
                             [thresholds[r] for r in live])
        for (r, per_node) in zip(live, out):
            req, tree, added = requests[r], trees[r], []
            for node, (logits, exit_layer) in per_node.items():
                added += _children(tree, node, tree.nodes.scores[node], logits, exit_layer, req.width)
            frontier[r] = _select(tree, added, req, tree.depths[frontier[r][0]] + 1, drafter.stop_confidence)
    for tree, prop in zip(trees, props):
        n = tree.nodes
        prop.tokens, prop.parents, prop.exits, prop.scores = n.tokens, n.parents, n.exits, n.scores
    return trees


def _children(tree: DraftTree, parent: int, base: float, logits: torch.Tensor, exit_layer: int, width: int
              ) -> list[int]:
    probs = torch.softmax(widen(logits), -1)
    top = torch.topk(probs, max(width, 1))
    out = []
    for tok, pr in zip(top.indices.tolist(), top.values.tolist()):
        if pr <= 0.0:  # outside a reduced-vocabulary head
            break
        out.append(tree.add(parent, tok, exit_layer, base * pr))
    return out


def _select(tree: DraftTree, added: list[int], req: DraftRequest, depth: int, stop_confidence: float) -> list[int]:
    """The next frontier: the `frontier` best of the nodes just added, while the tree may grow deeper, a node's path
    probability is above the round's floor (EAGLE-2's dynamic depth) and its own q above `stop_confidence`."""
    if depth >= req.k:
        return []
    scores, parents = tree.nodes.scores, tree.nodes.parents

    def own(i: int) -> float:
        return scores[i] / scores[parents[i]] if parents[i] >= 0 else scores[i]

    ok = [i for i in added if scores[i] >= req.min_score and scores[i] > 0 and own(i) >= stop_confidence]
    return sorted(ok, key=lambda i: (-scores[i], i))[: req.frontier]


def _frontier_step(drafter: FrontierDrafter, states: list[RowState], trees: list[DraftTree],
                   frontier: list[list[int]], thresholds: list[Sequence[float]]
                   ) -> list[dict[int, tuple[torch.Tensor, int]]]:
    """Run every row's frontier nodes through the draft, segment by segment, each node leaving at its own exit;
    rows needing much lazy fill run apart from the others. Returns, per row, node -> (logits, exit layer)."""
    out: list[dict[int, tuple[torch.Tensor, int]]] = [{} for _ in trees]
    active = [list(f) for f in frontier]
    stack, cache, hidden = drafter.stack, drafter.cache, drafter.hidden
    last = len(drafter.exit_layers) - 1
    for seg, exit_layer in enumerate(drafter.exit_layers):
        rows = [r for r in range(len(trees)) if active[r]]
        if not rows:
            break
        pend = {r: trees[r].pending(seg, active[r]) for r in rows}
        firsts = {r: min(states[r].filled[seg], trees[r].start) for r in rows}
        counts = [trees[r].start - firsts[r] + len(pend[r]) for r in rows]
        picked: list[tuple[int, int, torch.Tensor]] = []  # (row, node, hidden at this exit)
        for group in length_groups(counts):
            grp = [rows[g] for g in group]
            slots, rope, allowed, valid = tree_grid([trees[r] for r in grp], [firsts[r] for r in grp],
                                                    [pend[r] for r in grp], stack.device)
            row_ids = torch.tensor([trees[r].row for r in grp], device=stack.device)
            hidden.reserve(int(row_ids.max()) + 1, int(slots.max()) + 1)
            if seg == 0:
                ids = torch.zeros(slots.shape, dtype=torch.long)
                for j, r in enumerate(grp):
                    toks = states[r].tokens[firsts[r]:] + [trees[r].nodes.tokens[i] for i in pend[r]]
                    ids[j, : len(toks)] = torch.tensor(toks)
                x = stack.embed(ids.to(stack.device))
            else:
                x = hidden.bufs[seg - 1][row_ids[:, None], torch.where(valid, slots, 0)]
            h = stack.run_segment(seg, x, row_ids, slots, cache, rope, allowed)
            if seg < last:
                r_idx = row_ids[:, None].expand_as(slots)
                hidden.bufs[seg][r_idx[valid], slots[valid]] = h[valid]
            for j, r in enumerate(grp):
                tree, n_c = trees[r], trees[r].start - firsts[r]
                states[r].filled[seg] = max(states[r].filled[seg], tree.start)
                for c, node in enumerate(pend[r]):
                    tree.filled[seg][node] = True
                    if node in active[r]:
                        picked.append((r, node, h[j, n_c + c]))
        logits = stack.logits(torch.stack([p[2] for p in picked]))
        conf = None if seg == last else torch.softmax(logits.float(), -1).amax(-1)
        still: list[list[int]] = [[] for _ in trees]
        for j, (r, node, _) in enumerate(picked):
            if seg == last or float(conf[j]) > thresholds[r][seg]:
                out[r][node] = (logits[j], exit_layer)
            else:
                still[r].append(node)
        active = still
    return out


def commit_path(tree: DraftTree, state: RowState, tokens: list[int], drafter: FrontierDrafter) -> None:
    """Keep only the path of `tree` that `tokens` (the caller's committed sequence) accepted: its KV and kept hidden
    states move to slots start, start + 1, ...; each segment's fill then covers the path as far as that segment
    computed it (nodes that left at a shallower exit stay to be lazily filled)."""
    path = PendingTree(tree.start, tree.nodes.tokens, tree.nodes.parents).path(tokens)
    if not path or len(state.tokens) != tree.start:
        return
    src = [tree.start + i for i in path]
    if src != list(range(tree.start, tree.start + len(path))):
        drafter.cache.reserve(state.row + 1, max(src) + 1)  # the path's leaf was never forwarded: maybe past the end
        drafter.cache.move_slots(state.row, src, tree.start)
        drafter.hidden.move_slots(state.row, src, tree.start)
    state.tokens = state.tokens + [tree.nodes.tokens[i] for i in path]
    for seg, done in enumerate(tree.filled):
        if state.filled[seg] < tree.start:
            continue
        n = 0
        while n < len(path) and done[path[n]]:
            n += 1
        state.filled[seg] = tree.start + n
