"""Logits processors: per-request changes to the target's next-token logits that stay exact under speculation.

A processor is a pure function of one position's HISTORY and its logits row. Speculation scores several positions
in one target forward (a chain's k + 1 rows, a tree's 1 + n rows), so every row is processed with its own history:
the committed tokens (prompt + generated) plus the draft tokens before it (a chain) or the node's ancestors (a tree).
Greedy output then equals plain decoding with the same processors, and sampling follows the processed target
distribution (tests/unit/test_processors.py). Processors that keep state (a grammar matcher) advance it lazily from
`committed`, which only ever grows between calls for one sequence.

A row whose token is banned (-inf after processing) can never be emitted there, so the engine drops deterministic
draft candidates (tree nodes, lookup, greedy chains) that a processor bans before verifying them: it probes each
candidate's parent history with a zero logits row (`prune_banned`). Dropping a candidate the target can never accept
changes no outcome's probability; a chain sampled with q is never cut by its tokens' values (the acceptance rule
already rejects a banned token with certainty). A processor that never bans declares `bans = False` and is not probed.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from .tree import node_paths
from .types import Proposal


class LogitsProcessor(Protocol):
    """One request's adjustment of its next-token logits (penalties, biases, bans, a grammar's mask)."""

    def __call__(self, committed: Sequence[int], branches: Sequence[Sequence[int]], logits: torch.Tensor) -> torch.Tensor:
        """Return processed logits [n, V]: row i scores the token after `committed` + `branches[i]`.

        `committed` is the sequence so far, prompt included (the processor was built knowing the prompt's length);
        `logits` is not modified in place.
        """
        ...


def apply_processors(processors: Sequence[LogitsProcessor], committed: Sequence[int],
                     branches: Sequence[Sequence[int]], logits: torch.Tensor) -> torch.Tensor:
    """Run the processors in order (as transformers' LogitsProcessorList does)."""
    for processor in processors:
        logits = processor(committed, branches, logits)
    return logits


def row_histories(proposal: Proposal) -> list[list[int]]:
    """The tokens after `committed` that each target row of a proposal has seen: a chain's row i, its first i draft
    tokens; a tree's row 0, nothing, and row 1 + i, node i's ancestors then node i."""
    if proposal.parents is not None:
        return [[], *node_paths(proposal.tokens, proposal.parents)]
    return [proposal.tokens[:i] for i in range(len(proposal.tokens) + 1)]


def process_rows(processors: Sequence[LogitsProcessor], committed: Sequence[int], proposal: Proposal,
                 logits: torch.Tensor) -> torch.Tensor:
    """The target's rows for `proposal` (logits: [rows, V]), each processed with its own history."""
    branches = row_histories(proposal)
    if len(branches) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} target rows for a proposal with {len(branches)}")
    return apply_processors(processors, committed, branches, logits)


def prune_banned(processors: Sequence[LogitsProcessor], committed: Sequence[int], proposal: Proposal,
                 vocab: int) -> Proposal:
    """`proposal` without the deterministic candidates a processor bans at their parent's history: a tree node and its
    subtree, a q-less chain from its first banned token on. A chain sampled with q is returned as it is."""
    banning = [p for p in processors if getattr(p, "bans", True)]
    if not banning or not proposal.tokens or (proposal.parents is None and proposal.q is not None):
        return proposal
    tokens, parents = proposal.tokens, proposal.parents
    if parents is None:
        branches = [tokens[:i] for i in range(len(tokens))]  # the parent of token i has seen tokens[:i]
        banned = _probe(banning, committed, branches, list(range(len(tokens))), tokens, vocab)
        cut = banned.index(True) if True in banned else len(tokens)
        return proposal if cut == len(tokens) else Proposal(tokens[:cut], None, proposal.exits[:cut])
    paths = node_paths(tokens, parents)
    inner = sorted(set(parents))  # -1 (the root) and every node with a child
    row = {p: r for r, p in enumerate(inner)}
    banned = _probe(banning, committed, [paths[p] if p >= 0 else [] for p in inner],
                    [row[p] for p in parents], tokens, vocab)
    kept: dict[int, int] = {}  # old index -> new index, nodes whose whole path survives
    for i, (p, out) in enumerate(zip(parents, banned)):
        if not out and (p < 0 or p in kept):
            kept[i] = len(kept)
    if len(kept) == len(tokens):
        return proposal
    return Proposal([tokens[i] for i in kept], None, [proposal.exits[i] for i in kept],
                    [kept[parents[i]] if parents[i] >= 0 else -1 for i in kept],
                    [proposal.scores[i] for i in kept] if proposal.scores is not None else None,
                    proposal.match_ngram)


def _probe(processors: Sequence[LogitsProcessor], committed: Sequence[int], branches: list[list[int]],
           rows: list[int], tokens: list[int], vocab: int) -> list[bool]:
    """Whether candidate j (token `tokens[j]` after history `branches[rows[j]]`) is -inf once processed."""
    zeros = torch.zeros(len(branches), vocab)
    out = apply_processors(processors, committed, branches, zeros)
    return torch.isneginf(out[rows, tokens]).tolist()
