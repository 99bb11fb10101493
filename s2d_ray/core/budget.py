"""How much to speculate this round: tree shape from configuration, size from measured costs and acceptance.

Round time ~= verify(B, n) + depth * draft(B); tokens per row ~= 1 + sum over verified nodes of P(node accepted).
With a cost model (calibration) the engine picks, every round, the draft depth that maximises modelled tokens per
second for the whole batch, then keeps the best n nodes per row for the same reason (n = 0 is plain decoding). As the
batch grows, verify(B, n) grows with B * n and the same rule shrinks trees to nothing; it grows them back when load
drops. Acceptance probabilities are learned online from this engine's own rounds (priors only until data arrives).

The budget learns from every finished round (`RoundObservation`), keeps per sequence what the draft has seen of it
(`DraftRows`, core/draft_rows.py), decides each round's plan in `SpeculationBudget.plan` from what rounds cost
(`RoundCosts`, core/round_costs.py) and now and then tries what it would not choose (`Exploration`), so that what it
decides by stays measured.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from .acceptance import AcceptanceModel
from .costs import CostModel
from .draft_rows import DraftRows
from .exploration import Exploration
from .round_costs import RoundCosts, RoundObservation, batch_bucket
from .tree import TokenTree


@dataclass(frozen=True)
class TreeShape:
    """What a tree may hold: `width` draft candidates per node, lookup candidates, at most `max_nodes` nodes;
    `frontier`: nodes the draft expands per depth (1: the top-1 spine, its siblings stay leaves)."""

    width: int = 1
    lookup: bool = False
    max_nodes: int = 24
    frontier: int = 1


@dataclass(frozen=True)
class RoundPlan:
    """What the drafter is asked for this round: the spine's depth cap and the path probability below which a
    row stops drafting deeper (EAGLE-2's dynamic depth; 0 = always draft `depth` deep)."""

    depth: int
    min_score: float = 0.0
    hold: frozenset[int] = frozenset()  # rows (indices into the plan's `rows`) that do not draft this round


class SpeculationBudget(RoundCosts):
    """Per round: how deep to draft and how many nodes each row keeps, from measured costs when there are some.

    Without costs: the policy's k and `max_nodes`. With costs (policy `auto`), everything is priced in seconds per
    token of the whole batch, measured online (`RoundCosts`) and seeded by calibration (`plan`, `node_cap`).
    """

    # From this many rows, measured rounds also veto drafting the model would do: with many rows, runs that drafted in
    # most rounds lost to plain decoding where runs that drafted in few won. Below it they do not: there the rounds
    # that skip the draft are mostly lookup-alone rounds, chosen because a prompt-lookup match proposes well, so they
    # look cheaper per token than drafting is, and deciding by them drafted less and lost at batch 1.
    MEASURED_DRAFT_FROM = 5
    # Catch-ups are priced from this many rows. At one row the only catch-up is a request's own prompt right after its
    # prefill, held or drafted for the whole request on one comparison of one-row rounds; served, that comparison held
    # nearly every prompt out of the draft and lost to drafting every prompt (lookup merged into the draft's trees is
    # what pays there).
    CATCH_UP_FROM = 2
    # A round that carries prompt chunks beside decoding rows may cost this many plain decode rounds: running streams
    # slow by at most that while a prompt joins, instead of waiting for its whole prefill.
    PROMPT_STALL = 2.0
    MIN_PROMPT_POSITIONS = 32

    def __init__(self, shape: TreeShape, costs: CostModel | None, max_depth: int) -> None:
        super().__init__(costs)
        self.shape, self.max_depth = shape, max_depth
        self.acceptance = AcceptanceModel()
        self.rows = DraftRows()
        self.exploration = Exploration()
        self._first_hit = [0.5 * 4.0, 4.0]  # [accepted, rounds] of depth-1 draft nodes, prior 0.5
        self._drafting = False  # this round's plan drafts

    @property
    def load_aware(self) -> bool:
        return self.costs is not None

    def behind(self, seq_id: str, length: int) -> int:
        """Tokens of a sequence `length` long that the draft must catch up on before it drafts for it."""
        return self.rows.behind(seq_id, length)

    def release(self, seq_id: str) -> None:
        """A sequence finished or was aborted: forget what the draft had seen of it."""
        self.rows.release(seq_id)

    def end_round(self, obs: RoundObservation, drafted: Mapping[str, int]) -> None:
        """The engine's report of a finished round: `obs` as measured (`batch`: its rows when none filled a prompt),
        `drafted`: the rows the draft ran for (seq id -> length when the round was planned). What the draft had seen
        of those rows decides `warm`, `filled` and whether the round is timed at all (`RoundObservation.batch`)."""
        lag = self.rows.record(self.rounds, drafted)
        timed = obs.batch if lag.warm or lag.joined else None
        self.observe_round(replace(obs, batch=timed, warm=lag.warm, filled=lag.filled))

    def prompt_positions(self, batch: int, cap: int) -> int:
        """Prompt positions a round of `batch` decoding rows may carry beside them (at most `cap`): the most whose
        mixed forward (the decode rows' positions plus the chunk's, priced on the same grid as verification, flattened
        as costs.py prices a forward) stays within `PROMPT_STALL` plain decode rounds; never fewer than
        `MIN_PROMPT_POSITIONS`, so a prompt always progresses."""
        if self.costs is None or cap <= self.MIN_PROMPT_POSITIONS:
            return cap
        limit = self.PROMPT_STALL * self.verify_ms(batch, 1)
        lo, hi = self.MIN_PROMPT_POSITIONS, cap  # verify(1, batch + lo) is taken to fit; find the last that does
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.verify_ms(1, batch + mid) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def lookup_pays(self, batch: int) -> bool:
        """Whether a round that does not draft should gather lookup candidates at all: not once lookup-only tree rounds
        measured slower per token than plain rounds at about this batch size (except in the rounds that re-check it,
        `Exploration.flips_trees`); such a round is then plain decoding with nothing else on it."""
        if self.costs is None:
            return True
        return self.measured_better(batch, "tree", "plain") is not False or self.exploration.flips_trees(self.rounds)

    def observe(self, tree: TokenTree | None, path: list[int]) -> None:
        """One row's verified tree and the accepted path (node indices)."""
        if tree is None:
            return
        self.acceptance.observe(tree, path)
        depths = tree.depths()
        drafted_first = [i for i, (d, s) in enumerate(zip(depths, tree.scores)) if d == 1 and s > 0]  # drafted: q > 0
        if drafted_first:
            self._first_hit[0] += float(bool(path) and path[0] in drafted_first)
            self._first_hit[1] += 1

    # --- decisions ----------------------------------------------------------------------------------------------
    def plan(self, batch: int, default_depth: int, prompts: int = 0,
             rows: list[tuple[int, int] | None] | None = None) -> RoundPlan:
        """This round's draft depth and node threshold for `batch` rows, `prompts` of which fill their prompt; `rows`:
        per row that may draft, (tokens the draft must catch up on first, tokens the row may still emit), None for a
        row that may not. Without costs: `default_depth`. With costs:
        - the draft runs at all only while a first depth pays for its whole cost: (1 + hit) * verify(B, 1) >
          verify(B, 2) + draft depth (`_draft_pays`; from `MEASURED_DRAFT_FROM` rows measured whole rounds may veto
          it, and `Exploration` drafts now and then where it does not pay, so that it comes back when load drops);
        - a row drafts one depth deeper while its spine's path probability, mapped to acceptance, is worth more than
          the depth costs: P(accept) * t_token > c_draft(B) / B (t_token: the batch's measured seconds per token;
          `RoundPlan.min_score`);
        - a row the draft has not seen lately (new, or back after rounds without the draft) drafts only if its
          catch-up pays (`_unpaid_catch_ups`, `RoundPlan.hold`): with many rows, catching up rows with few tokens
          left cost more than drafting gained them."""
        if self.costs is None:
            return RoundPlan(default_depth)
        if self.shape.width < 1 or self.max_depth < 1:
            return RoundPlan(0)
        needed = min(max(self.depth_seconds(batch) / (max(batch, 1) * self.token_seconds(batch)), 0.02), 0.95)
        hit = self._first_hit[0] / self._first_hit[1]
        self._drafting = False
        v1, v2 = self.verify_ms(batch, 1), self.verify_ms(batch, 2)
        if (1 + hit) * v1 <= v2:  # not even free drafts would pay at this batch size
            return RoundPlan(0)
        chosen = self._draft_pays(batch, hit, v1, v2, prompts)
        explore = self.exploration.drafts(self.rounds, batch_bucket(batch), batch >= self.MEASURED_DRAFT_FROM, chosen,
                                          prompts)
        if chosen is None:
            return RoundPlan(0)
        draft = chosen or explore
        hold: frozenset[int] = frozenset()
        if draft and rows and batch >= self.CATCH_UP_FROM:
            hold = self._unpaid_catch_ups(rows, batch, self._token_gain_ms(batch, v1, v2, hit) if chosen else 0.0, v1)
            draft = any(r is not None and i not in hold for i, r in enumerate(rows))
        self._drafting = draft
        return RoundPlan(self.max_depth, self.acceptance.score_for(needed), hold) if draft else RoundPlan(0)

    def _draft_pays(self, batch: int, hit: float, v1: float, v2: float, prompts: int) -> bool | None:
        """Whether drafting pays this round: a row's first node, at its hit rate, buys more tokens than its
        verification width and the draft forward cost the whole batch. From `MEASURED_DRAFT_FROM` rows, whole drafting
        rounds measured slower per token than rounds without the draft veto it; and None while rounds without the draft
        were never (or not lately) timed there: nothing could veto a run that drafted from its first round, so this
        decode round is timed without the draft."""
        draft = (1 + hit) * v1 > v2 + 1000.0 * self.depth_seconds(batch)
        if not draft or batch < self.MEASURED_DRAFT_FROM:
            return draft
        if self.measured_better(batch, "draft", "nodraft") is False:
            return False
        if not prompts and (self._timed(batch_bucket(batch), "nodraft") < self.MEASURED_AFTER
                            or self.exploration.times_without_draft(self.rounds)):
            return None
        return True

    def _token_gain_ms(self, batch: int, v1: float, v2: float, hit: float) -> float:
        """What drafting saves per token emitted at this batch size, ms: measured (plain rounds' ms a token less
        drafting rounds') once both kinds are timed here, else the first depth's modelled saving per round over the
        (1 + hit) tokens a row emits in one. Plain rounds, not all rounds without the draft: a row held out of the draft
        still gets lookup-alone rounds where its match is long, so those are no part of what drafting changes; the
        first depth alone undervalues drafting where deeper depths and lookup merges carry the gain, and held out the
        long prompts' draft for good."""
        drafting, plain = self._token_s(batch, "draft"), self._token_s(batch, "plain")
        if drafting is not None and plain is not None:
            return max(1000.0 * (plain - drafting), 0.0)
        saved = (1 + hit) * v1 - v2 - 1000.0 * self.depth_seconds(batch)
        return max(saved, 0.0) / (max(batch, 1) * (1 + hit))

    def _unpaid_catch_ups(self, rows: list[tuple[int, int] | None], batch: int, gain_ms: float,
                          v1: float) -> frozenset[int]:
        """Rows whose catch-up (tokens behind x the draft's measured seconds per filled token) costs more than drafting
        can gain them: `gain_ms` a remaining token (0 in an exploration), or at least a row's share of one plain step
        (what a round may spend to keep acceptance measured)."""
        fill_ms = 1000.0 * self.fill_seconds()
        allowance = v1 / max(batch, 1)
        hold = set()
        for i, row in enumerate(rows):
            if row is None:
                continue
            behind, remaining = row
            if behind * fill_ms > max(gain_ms * remaining, allowance):
                hold.add(i)
        return frozenset(hold)
    def node_cap(self, estimates: list[list[float]]) -> int:
        """Nodes per row (the same for every row: a batch is as wide as its widest row) that maximise modelled
        tokens per verification second; 0 means a plain decoding step. In a round that does not draft, once this
        engine has timed enough decode rounds of both kinds at about this batch size, lookup-only tree rounds are kept
        only while their measured seconds per token beat plain rounds': the model prices nodes against one plain step,
        where a served plain round takes several steps per target call and pays one call overhead for them."""
        cap = self.shape.max_nodes
        if self.costs is None:
            return cap
        batch = max(len(estimates), 1)
        widest = min(cap, max((len(e) for e in estimates), default=0))
        if not self._drafting:
            trees = self.measured_better(batch, "tree", "plain")
            if trees is not None and self.exploration.flips_trees(self.rounds):
                trees = not trees
            if trees is False:
                return self._unpriced(batch, widest)
        ranked = [sorted(e, reverse=True) for e in estimates]
        best_n, best_rate = 0, batch / self.verify_ms(batch, 1)
        gained = 0.0
        for n in range(1, widest + 1):
            gained += sum(r[n - 1] for r in ranked if len(r) >= n)
            rate = (batch + gained) / self.verify_ms(batch, n + 1)
            if rate > best_rate:
                best_n, best_rate = n, rate
        if best_n == 0:
            return self._unpriced(batch, widest)
        self.exploration.kept_nodes(batch_bucket(batch))
        return best_n

    def _unpriced(self, batch: int, offered: int) -> int:
        """Nodes to verify in a round whose `offered` nodes the budget keeps none of: 0, or all of them when
        `Exploration` says so (a CPU where two positions cost one and a half steps kept lookup off for good after a few
        rejected lookup nodes early in a run, where prompt lookup would have paid)."""
        if offered == 0:
            return 0
        return offered if self.exploration.verifies_idle_nodes(batch_bucket(batch)) else 0

