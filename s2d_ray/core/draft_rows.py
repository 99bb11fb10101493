"""Per live sequence, what the draft has seen of it: which rows a round's draft must catch up on first.

A row the draft skipped (held out, or new) is behind by every token since it last drafted; the budget prices that
catch-up and times a round only when its drafting rows were warm (`SpeculationBudget.end_round`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

NEVER_DRAFTED = -2  # the round a sequence the draft has not run for "last drafted in"


@dataclass(frozen=True)
class DraftLag:
    """How a round's drafting rows stood with the draft (see `RoundObservation`, core/round_costs.py): `warm` every
    one drafted the round before; `joined` the others are new to the draft, beside warm rows; `filled` the tokens
    caught up on."""

    warm: bool
    joined: bool
    filled: int


class DraftRows:
    """Per live sequence, what the draft has seen of it: the round it last drafted in and its length then."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, int]] = {}  # seq id -> (round, tokens the draft had seen)

    def behind(self, seq_id: str, length: int) -> int:
        """Tokens of a sequence `length` long that the draft must catch up on before it drafts."""
        return length - self._seen.get(seq_id, (NEVER_DRAFTED, 0))[1]

    def record(self, round_index: int, drafted: Mapping[str, int]) -> DraftLag:
        """Round `round_index` drafted for `drafted` (seq id -> its length when the round was planned)."""
        before = {seq_id: self._seen.get(seq_id, (NEVER_DRAFTED, 0)) for seq_id in drafted}
        last = {seq_id: at == round_index - 1 for seq_id, (at, _) in before.items()}
        warm = all(last.values())
        joined = any(last.values()) and all(last[s] or before[s][0] == NEVER_DRAFTED for s in drafted)
        filled = sum(length - before[s][1] for s, length in drafted.items() if not last[s])
        for seq_id, length in drafted.items():
            self._seen[seq_id] = (round_index, length)
        return DraftLag(warm, joined, filled)

    def release(self, seq_id: str) -> None:
        self._seen.pop(seq_id, None)
