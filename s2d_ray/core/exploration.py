"""The speculation budget's exploration policy: which rounds try what the budget would not choose (core/budget.py).

A budget that only ever runs what its model and measurements favour stops measuring the alternatives, while
acceptance and load change under it.
"""

from __future__ import annotations


class Exploration:
    """When the budget tries what it would not choose, so that the measurements it decides by stay current:
    - drafting it does not choose: one round in `EVERY`; where measured rounds decide (from
      `SpeculationBudget.MEASURED_DRAFT_FROM` rows) a pair of rounds instead, the first catching the draft up
      (untimed), the second timed, whose gap doubles while drafting keeps losing (at most `BACKOFF` x `EVERY`); such
      a pair neither starts nor ends on a round that fills a prompt (a prompt round is never timed, so the pair's
      catch-up would pay for nothing);
    - rounds without the draft while drafting is chosen there: one round in `EVERY` (`times_without_draft`);
    - lookup-only tree rounds against plain ones, once both are measured: one round in `EVERY` (`flips_trees`);
    - nodes the budget prices out: all of them, one such round in `EVERY` per batch size, the gap doubling likewise
      (`verifies_idle_nodes`); unverified nodes teach the acceptance model nothing, so estimates that a few unlucky
      rounds pushed below the pay line would stay there for good.
    """

    EVERY = 16
    # A pair costs a catch-up and wide verification; while drafting keeps losing, it comes at most this many times
    # less often.
    BACKOFF = 16

    def __init__(self) -> None:
        self.gaps: dict[int, int] = {}  # batch bucket (measured) -> rounds between drafting pairs
        self._second: int | None = None  # the bucket whose pair's timed second round is next
        self._due: int | None = None  # the bucket whose pair waits for a round without a prompt
        self._idle: dict[int, tuple[int, int]] = {}  # batch bucket -> (rounds offered nodes and kept none, gap)

    def drafts(self, round_index: int, bucket: int, measured: bool, chosen: bool | None, prompts: int) -> bool:
        """Whether this round drafts to explore, given what the budget `chosen` (None: time a round without the draft)
        for `bucket`; `measured`: measured rounds decide drafting there; `prompts`: rows that fill their prompt."""
        gap = self.gaps.get(bucket, self.EVERY) if measured else self.EVERY
        second, self._second = self._second == bucket, None
        due, self._due = self._due == bucket, None
        explore = second or due or round_index % gap == 0
        if chosen is None:
            return False
        if measured and chosen:
            self.gaps.pop(bucket, None)
        elif measured and explore and prompts:  # a pair waits; its second round drafts (keeps rows warm) and waits
            self._second, self._due = (bucket, None) if second else (None, bucket)
            explore = second
        elif measured and explore and not second:
            self.gaps[bucket] = self._backed_off(gap)
            self._second = bucket
        return explore

    def times_without_draft(self, round_index: int) -> bool:
        return round_index % self.EVERY == 0

    def flips_trees(self, round_index: int) -> bool:
        return round_index % self.EVERY == self.EVERY // 2

    def verifies_idle_nodes(self, bucket: int) -> bool:
        """Whether a round at this batch size whose offered nodes the budget keeps none of verifies them all."""
        since, gap = self._idle.get(bucket, (0, self.EVERY))
        if since + 1 < gap:
            self._idle[bucket] = (since + 1, gap)
            return False
        self._idle[bucket] = (0, self._backed_off(gap))
        return True

    def kept_nodes(self, bucket: int) -> None:
        """The budget kept nodes at this batch size: idle-node exploration starts over."""
        self._idle.pop(bucket, None)

    def _backed_off(self, gap: int) -> int:
        return min(2 * gap, self.EVERY * self.BACKOFF)
