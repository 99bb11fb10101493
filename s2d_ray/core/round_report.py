"""Step 6 of a round: what the load-aware budget (core/budget.py) learns from it, its measured cost and yield."""

from __future__ import annotations

from typing import Any

from .budget import SpeculationBudget
from .round_costs import RoundObservation
from .requests import SequenceState, StepOutput
from .tree import proposal_tree
from .types import Proposal, ScoreRequest


def round_facts(live: list[SequenceState], requests: list[ScoreRequest], proposals: list[Proposal],
                times: tuple[float, float, float], chunks: bool = False) -> dict[str, Any]:
    """What the budget learns a round by that commit changes (`RoundObservation` fields): the draft's seconds,
    whether a row filled its prompt (`prompt`; else `batch`, the rows, for a round that may be timed), the
    verification when it was a one-step decode round, and the most tree nodes a row verified."""
    t0, t1, t2 = times
    decode = all(seq.generated for seq in live) and not chunks  # a prompt chunk's forward is no decode cost
    one_step = decode and not any(r.steps > 1 for r in requests)
    verify = (t2 - t1, len(requests), max(r.num_logits for r in requests)) if one_step else None
    return dict(draft_seconds=t1 - t0, verify=verify, batch=len(live) if decode else None, prompt=not decode,
                nodes=max((len(p.tokens) for p in proposals), default=0))


def report_round(budget: SpeculationBudget, live: list[SequenceState], lengths: list[int], drafted: list[Proposal],
                 outputs: list[StepOutput], facts: dict[str, Any], still_live: dict[str, SequenceState]) -> None:
    """The round's measured cost and yield, to the budget (`drafted`: the proposals as drafted, before the node
    budget cut them, so the draft seconds are divided by the depth the draft really ran); the rows no longer in
    `still_live` (finished, or aborted while the round was in flight) are released from it."""
    depths = [drafted_depth(p) for p in drafted]
    rows = {seq.req.seq_id: n for seq, n, d in zip(live, lengths, depths) if d > 0}
    obs = RoundObservation(tokens=sum(len(o.new_tokens) for o in outputs), depth=max(depths, default=0), **facts)
    budget.end_round(obs, rows)
    for seq in live:
        if seq.req.seq_id not in still_live:
            budget.release(seq.req.seq_id)


def drafted_depth(prop: Proposal) -> int:
    """How deep the draft itself ran for a proposal: its deepest node with q > 0 (lookup-only nodes score 0)."""
    tree = proposal_tree(prop)
    return max((d for d, s in zip(tree.depths(), tree.scores) if s > 0), default=0)
