"""Intra-op threads per pass: a wide pass (a prompt, a token tree, a big batch) takes more cores than a one-row step.

A replica that shares the machine's cores with the draft, the router and the other replicas runs narrow steps on one
thread; a wide pass is a few larger matmuls that a second core speeds up, and it does not overlap the same router's
draft forward: a round drafts, then verifies."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

# A pass over at least this many (padded) positions counts as wide. Alone, a second thread speeds every pass, even one
# row's step; served, giving it to one-row steps loses (the router, proxy and client share the cores between steps
# and a descheduled peer stalls the pass), while prompts, trees and many-row rounds gain (see BENCHMARKS.md).
WIDE_PASS_POSITIONS = 16


@contextlib.contextmanager
def intra_op_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op thread count on this thread set to n inside the block (None or the current count: as is)."""
    before = torch.get_num_threads()
    if not n or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pass_threads(wide_threads: int | None, positions: int) -> int | None:
    """The thread count a pass over `positions` positions runs with (None: the thread's own)."""
    return wide_threads if wide_threads and positions >= WIDE_PASS_POSITIONS else None
