"""Prompt chunks carried in the decode rows' forward (mixed batches), and how many prompt positions a round carries.

A forward pads every row to its widest, so a prompt chunk of C positions next to decode rows of a few positions would
pad each decode row to C (why `length_groups` gives prompts their own forwards). Instead a chunk is folded into
pieces as wide as the decode rows, each piece a grid row of its own that writes and reads the SAME cache row at its
own positions: a layer writes every grid row's K/V before any query attends, so piece j sees pieces 0..j-1 of the
same layer, and a query at position p sees slots 0..p of its cache row, exactly what one pass over the chunk computes.
A round then runs one target forward for its decode rows and the prompt chunks it carries (vLLM's and SGLang's mixed
batches), instead of one forward per prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rows import FREE_WIDTH

# Pieces one prompt row may be folded into: each piece attends over its whole cache row, so many narrow pieces cost
# what many decode rows do; a chunk that needs more pieces than this at a width padding pays for runs apart.
MAX_PIECES = 4


@dataclass(frozen=True)
class Piece:
    """One grid row of a mixed forward: positions start..end (inclusive) of request `index`."""

    index: int
    start: int
    end: int


def fold_plan(counts: list[int], foldable: list[bool],
              free_width: int = FREE_WIDTH) -> tuple[int, list[int], list[int]] | None:
    """How a batch's rows run as one mixed forward: (piece width, the rows folded into pieces, the rows left to
    forwards of their own), or None when no row is worth folding.

    The width is the widest row that is not folded (the decode rows: chains, trees), raised so that no folded row
    needs more than MAX_PIECES pieces, and never past `free_width` positions over it (padding a decode row by that
    costs about what one more forward's fixed overhead does, `length_groups`' rule); a longer prompt keeps forwards
    of its own. `foldable`: rows that may be folded (plain causal positions: no tree nodes)."""
    narrow = min(counts, default=0)
    decode = [c for c, f in zip(counts, foldable) if not f or c <= narrow + free_width]
    if not decode:
        return None
    base = max(decode)
    folded = [i for i, (c, f) in enumerate(zip(counts, foldable)) if f and base < c <= MAX_PIECES * (base + free_width)]
    if not folded:
        return None
    width = max(base, *(-(-counts[i] // MAX_PIECES) for i in folded))
    rest = [i for i, c in enumerate(counts) if c > base and i not in folded]
    return width, folded, rest


def pieces(starts: list[int], ends: list[int], folded: list[int], width: int) -> list[Piece]:
    """Grid rows of a mixed forward: every row whole, except the folded ones cut into pieces of `width` positions."""
    out = []
    cut = set(folded)
    for i, (s, e) in enumerate(zip(starts, ends)):
        if i not in cut:
            out.append(Piece(i, s, e))
            continue
        for lo in range(s, e + 1, width):
            out.append(Piece(i, lo, min(lo + width, e + 1) - 1))
    return out


def piece_allowed(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[n, s, kv_len] bool: a query at slot p of a piece sees slots 0..p of its cache row (and nothing past its own
    position: the later pieces of its chunk write their K/V in the same layer call)."""
    slots = torch.arange(kv_len, device=positions.device)
    return slots[None, None, :] <= positions[:, :, None]


def round_prompt_positions(pending: list[int], allowance: int) -> list[int]:
    """Prompt positions each prompt row fills this round (`pending`: what each still has to fill, in admission order),
    first come first served within `allowance` positions; 0 for a row that waits for a later round."""
    out = []
    for n in pending:
        take = min(n, max(allowance, 0))
        out.append(take)
        allowance -= take
    return out
