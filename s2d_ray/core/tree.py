"""Token trees: several candidate continuations verified in ONE target forward, and exact acceptance over them.

A tree hangs below the sequence's last committed token (the root, index -1). Nodes are stored in topological order
(a parent before its children) with the parent's index, the token, where it came from (`exits`: the draft exit it
left at, or LOOKUP for a free n-gram candidate) and a score: the draft's probability of the path to the node, used
to rank nodes for the budget (EAGLE-2's rule; any ranking is exact because every candidate is verified).

Acceptance walks down from the root. At each accepted node its children are the candidates:
- greedy: accept the child whose token is the target's argmax (siblings are merged by token, so at most one); the
  round ends with the target's argmax at the last accepted node (the bonus token);
- sampling: every tree candidate is DETERMINISTIC (chosen from draft logits / the text without looking at any
  acceptance coin), so each is a point-mass proposal (SpecInfer's multi-candidate rule with
  q = delta): accept child x with probability r(x); on rejection set r(x) = 0 and renormalise; when every child is
  rejected, draw the output from the residual r. By induction the emitted token at each depth is distributed
  exactly as the target's r, whatever candidates were offered. (A sampled-with-q chain keeps using
  `sampling.rejection_sample`, which applies min(1, p/q).)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling import logits_to_probs, sample
from .types import Proposal, SamplingParams

LOOKUP = 0  # `exits` of a node n-gram lookup proposed, over the request's text or earlier outputs (draft exits >= 1)
LOOKUP_BRANCH = -1  # a node only lookup's other continuations proposed (an older occurrence; accepted less often)


def is_lookup(exit_layer: int) -> bool:
    return exit_layer <= LOOKUP


@dataclass
class TokenTree:
    """Nodes below the root in topological order; `parents[i]` is -1 for a child of the root."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    exits: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    # Suffix length the first lookup candidate matched (0: no lookup candidate): a 4-token match is accepted ~3x as
    # often as a 1-token one, so the budget values lookup nodes by it.
    match_ngram: int = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def child(self, parent: int, token: int) -> int | None:
        for i, (p, t) in enumerate(zip(self.parents, self.tokens)):
            if p == parent and t == token:
                return i
        return None

    def add(self, parent: int, token: int, exit_layer: int, score: float) -> int:
        """Add a node (or merge into an existing sibling with the same token, keeping the higher score; a lookup
        candidate merged into a draft node marks it LOOKUP, so the budget values it by both sources, not the draft's
        alone, and the lookup chain below it is not cut by the draft node's lower estimate; LOOKUP outranks
        LOOKUP_BRANCH, which outranks a draft exit)."""
        same = self.child(parent, token)
        if same is not None:
            self.scores[same] = max(self.scores[same], score)
            if is_lookup(exit_layer) and (not is_lookup(self.exits[same]) or exit_layer > self.exits[same]):
                self.exits[same] = exit_layer
            return same
        self.tokens.append(token)
        self.parents.append(parent)
        self.exits.append(exit_layer)
        self.scores.append(score)
        return len(self.tokens) - 1

    def add_path(self, tokens: list[int], exits: list[int], scores: list[float], parent: int = -1) -> list[int]:
        """A chain below `parent`, merged into the tree where it shares a prefix; returns its node indices."""
        out = []
        for tok, ex, sc in zip(tokens, exits, scores):
            parent = self.add(parent, tok, ex, sc)
            out.append(parent)
        return out

    def depths(self) -> list[int]:
        return node_depths(self.parents)

    def proposal(self) -> Proposal:
        """This tree as a drafter's proposal (deterministic nodes: no q)."""
        return Proposal(self.tokens, None, self.exits, self.parents, self.scores, self.match_ngram)

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def keep(self, budget: int, rank: list[float] | None = None, max_depth: int | None = None) -> "TokenTree":
        """The best `budget` nodes by `rank` (default: score; ties by score), no deeper than `max_depth`, closed under
        ancestors (a node comes with its path), reindexed in the same topological order."""
        depths = self.depths()
        if max_depth is not None and any(d > max_depth for d in depths):
            budget = min(budget, sum(d <= max_depth for d in depths))
        elif budget >= len(self):
            return self
        if budget <= 0:
            return TokenTree(match_ngram=self.match_ngram)
        rank = self.scores if rank is None else rank
        allowed = [i for i in range(len(self)) if max_depth is None or depths[i] <= max_depth]
        # Ranks are often binned estimates: ties go to the higher draft path probability (a frontier tree holds many
        # nodes of one bin at different depths), then the shallower node.
        order = sorted(allowed, key=lambda i: (-rank[i], -self.scores[i], depths[i], i))
        chosen: set[int] = set()
        for i in order:
            path = []
            j = i
            while j >= 0 and j not in chosen:
                path.append(j)
                j = self.parents[j]
            if len(chosen) + len(path) > budget:
                continue
            chosen.update(path)
            if len(chosen) == budget:
                break
        kept = sorted(chosen)
        index = {old: new for new, old in enumerate(kept)}
        return TokenTree([self.tokens[i] for i in kept], [index.get(self.parents[i], -1) for i in kept],
                         [self.exits[i] for i in kept], [self.scores[i] for i in kept], self.match_ngram)


def proposal_tree(prop: Proposal) -> TokenTree:
    """A proposal as a tree: a chain is a tree whose node i's parent is i - 1 (scores 1 where it has none)."""
    n = len(prop.tokens)
    parents = prop.parents if prop.parents is not None else list(range(-1, n - 1))
    scores = prop.scores if prop.scores is not None else [1.0] * n
    return TokenTree(list(prop.tokens), list(parents), list(prop.exits), list(scores), prop.match_ngram)


def node_depths(parents: list[int]) -> list[int]:
    """Depth of each node (children of the root have depth 1); parents come before children."""
    d: list[int] = []
    for p in parents:
        d.append(1 if p < 0 else d[p] + 1)
    return d


def node_paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Each node's tokens from the root down, the node's own last (what a row after the node has seen)."""
    paths: list[list[int]] = []
    for tok, p in zip(tokens, parents):
        paths.append((paths[p] if p >= 0 else []) + [tok])
    return paths


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: entry (i, j) is True when node j is node i or one of its ancestors (what node i attends to)."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def accept_tree(
    tree: TokenTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Walk the tree against target logits [1 + n, V] (row 0 at the root, row 1 + i at node i; greedy rows may be
    the argmax ids [1 + n] instead).

    Returns (accepted node indices from the root down, the next token: bonus or drawn from the residual).
    """
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents):
        kids.setdefault(p, []).append(i)
    path: list[int] = []
    node = -1
    while True:
        row = logits[node + 1]
        cands = kids.get(node, [])
        if params.greedy:
            best = int(row) if row.dim() == 0 else int(row.argmax())
            nxt = next((c for c in cands if tree.tokens[c] == best), None)
            if nxt is None:
                return path, best
            path.append(nxt)
            node = nxt
            continue
        r = logits_to_probs(row, params).double()
        accepted = None
        for c in cands:
            tok = tree.tokens[c]
            total = float(r.sum())
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if total > 0 and u < float(r[tok]) / total:
                accepted = c
                break
            r[tok] = 0.0  # rejected point mass: the residual is r without it, renormalised
        if accepted is None:
            total = float(r.sum())
            return path, sample(r / total if total > 0 else logits_to_probs(row, params), generator)
        path.append(accepted)
        node = accepted
