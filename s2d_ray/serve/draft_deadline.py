"""How long a router waits for the shared draft, and how long it decodes target-only after the draft failed.

A draft that hangs (alive, never answering) must not cost a fixed 30 s of every round: the wait for a propose call
follows the draft's measured speed, as seconds per drafted position (the positions a call makes the draft compute:
each row's tokens it does not hold yet plus its k draft steps) times a margin, plus a floor for transport and the
draft's batching window, never above `call_timeout_s`. Until enough calls have been measured (warm-up, lazy loads)
the cap applies. After a failure the router decodes target-only (still exact) for `retry_after_s`, doubled after each
failure in a row up to `retry_max_s`, and back to `retry_after_s` after a call that succeeds; so a hung draft costs
one short wait per backoff period.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class DeadlinePolicy:
    cap_s: float  # draft.call_timeout_s
    retry_after_s: float
    retry_max_s: float = 60.0
    margin: float = 4.0  # the measured worst rate, times this
    floor_s: float = 0.5  # Ray transport, the draft's batch window, a GC pause
    min_samples: int = 4
    window: int = 64  # calls the worst rate is taken over


class DraftDeadline:
    """One router's timeout for its draft calls and its backoff after failures."""

    def __init__(self, policy: DeadlinePolicy) -> None:
        self.policy = policy
        self._rates: deque[float] = deque(maxlen=policy.window)  # seconds per drafted position, recent calls
        self.failures = 0  # in a row

    def timeout(self, positions: int) -> float:
        """The wait for a call that drafts `positions` positions."""
        p = self.policy
        if len(self._rates) < p.min_samples:
            return p.cap_s
        return min(p.cap_s, p.floor_s + p.margin * max(self._rates) * max(positions, 1))

    def succeeded(self, seconds: float, positions: int) -> None:
        self._rates.append(seconds / max(positions, 1))
        self.failures = 0

    def failed(self) -> float:
        """Seconds to decode target-only before trying the draft again."""
        self.failures += 1
        p = self.policy
        return min(p.retry_after_s * 2 ** (self.failures - 1), max(p.retry_max_s, p.retry_after_s))


def drafted_positions(rows, seen: list[int]) -> int:
    """Positions a propose call makes the draft compute: tokens it does not hold yet plus k draft steps per row."""
    return sum(max(len(r.tokens) - s, 1) + r.k for r, s in zip(rows, seen))
