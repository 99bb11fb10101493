"""How much to speculate this round: tree shape from configuration, size from measured costs and acceptance.

Round time ~= verify(B, n) + depth * draft(B); tokens per row ~= 1 + sum over verified nodes of P(node accepted).
With a cost model (calibration) the engine picks, every round, the draft depth that maximises modelled tokens per
second for the whole batch, then keeps the best n nodes per row for the same reason (n = 0 is plain decoding). As the
batch grows, verify(B, n) grows with B * n and the same rule shrinks trees to nothing; it grows them back when load
drops. Acceptance probabilities are learned online from this engine's own rounds (priors only until data arrives).

The budget learns from every finished round (`RoundObservation`), keeps per sequence what the draft has seen of it
(`DraftRows`), decides each round's plan in `SpeculationBudget.plan` and now and then tries what it would not choose
(`Exploration`), so that what it decides by stays measured.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from .acceptance import AcceptanceModel
from .costs import CostModel
from .exploration import Exploration
from .tree import TokenTree

NEVER_DRAFTED = -2  # the round a sequence the draft has not run for "last drafted in"


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


@dataclass(frozen=True)
class RoundObservation:
    """One finished round of the whole batch, as the budget learns from it."""

    seconds: float  # wall seconds of the round
    tokens: int  # tokens it emitted, all rows together
    draft_seconds: float = 0.0  # of which the draft's
    depth: int = 0  # the deepest draft depth a row ran (0: the draft did not run)
    # (seconds, batch, positions) of its verification when it was a one-step decode round (no row filled its prompt,
    # no row took several plain steps), else None: a prompt round costs what the prompt costs, not what the grid models.
    verify: tuple[float, int, int] | None = None
    # Its rows when the round is fit to time a kind of round by, else None: no row filled a prompt, and every drafting
    # row drafted the round before or is new to the draft (the first draft after a pause catches up on every token
    # since, but filling a joining sequence's prompt is what drafting costs while sequences come and go).
    batch: int | None = None
    nodes: int = 0  # the most tree nodes a row verified
    prompt: bool = False  # a row filled its prompt
    warm: bool = True  # every drafting row drafted the round before: the draft's time is its depths only
    filled: int = 0  # tokens the draft caught up on for the drafting rows that did not


@dataclass(frozen=True)
class DraftLag:
    """How a round's drafting rows stood with the draft (see `RoundObservation`): `warm` every one drafted the round
    before; `joined` the others are new to the draft, beside warm rows; `filled` the tokens caught up on."""

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


class SpeculationBudget:
    """Per round: how deep to draft and how many nodes each row keeps, from measured costs when there are some.

    Without costs: the policy's k and `max_nodes`. With costs (policy `auto`), everything is priced in seconds per
    token of the whole batch, measured online and seeded by calibration (`plan`, `node_cap`). Verification costs are
    the calibrated grid times a factor learned from this engine's own decode rounds (`scale`: the grid was measured at
    one context length on an idle machine; long contexts, other load and a remote verifier's call overhead make real
    rounds dearer, and a budget that trusts the grid keeps drafting where it loses). Whole decode rounds are timed by
    kind (drafted / lookup-only tree / plain, and `nodraft` for the last two) per batch-size bucket and shown in the
    router's stats (`measured`, `spent_by_kind`).
    """

    MEASURED_AFTER = 3  # decode rounds of each kind at a batch size before their measured rates decide
    # From this many rows, measured rounds also veto drafting the model would do: with many rows, runs that drafted in
    # most rounds lost to plain decoding where runs that drafted in few won. Below it they do not: there the rounds
    # that skip the draft are mostly lookup-alone rounds, chosen because a prompt-lookup match proposes well, so they
    # look cheaper per token than drafting is, and deciding by them drafted less and lost at batch 1.
    MEASURED_DRAFT_FROM = 5
    FILL_SAMPLE_TOKENS = 16  # a catch-up teaches the fill cost from this many filled tokens (fewer: mostly noise)
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
        self.shape, self.costs, self.max_depth = shape, costs, max_depth
        self.acceptance = AcceptanceModel()
        self.rows = DraftRows()
        self.exploration = Exploration()
        self.rounds = 0
        # EMAs: seconds per round, tokens per round (whole batch), draft seconds per depth, first-depth draft hits.
        self._round_s = self._round_tokens = self._depth_s = None
        self._first_hit = [0.5 * 4.0, 4.0]  # [accepted, rounds] of depth-1 draft nodes, prior 0.5
        self.scale = 1.0  # measured verify seconds over the grid's, EMA over decode rounds
        # (batch bucket, kind) -> [EMA seconds, EMA tokens, rounds] of whole decode rounds
        self._kinds: dict[tuple[int, str], list[float]] = {}
        # kind -> [rounds, seconds, tokens, draft seconds] of every round (prompt rounds and drafting rounds that
        # caught up too): where the time went, for stats; the choices use `_kinds`
        self.spent: dict[str, list[float]] = {}
        self._drafting = False  # this round's plan drafts
        self._fill_s: float | None = None  # EMA: draft seconds per token a catch-up filled

    @property
    def load_aware(self) -> bool:
        return self.costs is not None

    def spent_by_kind(self) -> dict[str, dict[str, float]]:
        """`spent` with named fields (rounds, seconds, tokens, draft_seconds) per kind of round, for stats."""
        return {kind: {"rounds": r, "seconds": s, "tokens": t, "draft_seconds": d}
                for kind, (r, s, t, d) in sorted(self.spent.items())}

    # --- measurements -------------------------------------------------------------------------------------------
    @staticmethod
    def _ema(old: float | None, new: float, alpha: float = 0.2) -> float:
        return new if old is None else (1 - alpha) * old + alpha * new

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

    def observe_round(self, obs: RoundObservation) -> None:
        """Learn from a finished round: its account by kind, the timed rates, and the costs it measured."""
        self.rounds += 1
        self._account(obs)
        if obs.batch and obs.tokens > 0:
            names = ("draft",) if obs.depth > 0 else ("tree" if obs.nodes > 0 else "plain", "nodraft")
            for name in names:
                kind = self._kinds.setdefault((_bucket(obs.batch), name), [obs.seconds, float(obs.tokens), 0.0])
                kind[0], kind[1] = self._ema(kind[0], obs.seconds), self._ema(kind[1], float(obs.tokens))
                kind[2] += 1
        self._round_s = self._ema(self._round_s, obs.seconds)
        self._round_tokens = self._ema(self._round_tokens, float(obs.tokens))
        self._learn_costs(obs)

    def _account(self, obs: RoundObservation) -> None:
        """Add the round to `spent` under its kind (prompt, draft, catch-up, tree, plain)."""
        if obs.prompt:
            kind = "prompt"
        elif obs.depth > 0:
            kind = "draft" if obs.batch and obs.warm else "catch-up"
        else:
            kind = "tree" if obs.nodes > 0 else "plain"
        spent = self.spent.setdefault(kind, [0, 0.0, 0, 0.0])
        spent[0], spent[1], spent[2], spent[3] = spent[0] + 1, spent[1] + obs.seconds, spent[2] + obs.tokens, \
            spent[3] + obs.draft_seconds

    def _learn_costs(self, obs: RoundObservation) -> None:
        """A draft depth's cost from warm timed drafting rounds only: a prompt round's draft time is mostly the draft
        filling the prompt, and a catch-up round's (the first draft after plain rounds, or a joining sequence's) mostly
        the draft catching up on every token since; counting them priced a depth at several times its cost, and the
        budget then never drafted again to correct it. A filled token's cost from catch-ups that filled enough tokens;
        the verification scale from one-step decode rounds."""
        depth, verify = obs.depth, obs.verify
        if depth > 0 and verify is not None and obs.batch and obs.warm:
            self._depth_s = self._ema(self._depth_s, obs.draft_seconds / depth)
        if depth > 0 and not obs.prompt and obs.filled >= self.FILL_SAMPLE_TOKENS and self.costs is not None:
            prior = self._fill_prior()
            rows = verify[1] if verify is not None else obs.batch or 1
            per_token = max(obs.draft_seconds - depth * self.depth_seconds(rows), 0.0) / obs.filled
            self._fill_s = self._ema(self._fill_s, min(max(per_token, 0.1 * prior), 10.0 * prior))
        if verify is not None and self.costs is not None:
            v_s, batch, positions = verify
            self.scale = self._ema(self.scale, min(max(1000.0 * v_s / self.costs.verify(batch, positions), 0.25), 8.0))

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

    def verify_ms(self, batch: int, positions: int) -> float:
        """Modelled ms of verifying `batch` rows of `positions`: the calibrated grid times the learned factor."""
        return self.scale * self.costs.verify(batch, positions)

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

    def token_seconds(self, batch: int) -> float:
        """Seconds per emitted token of the whole batch (measured; before any round, plain decoding's)."""
        if self._round_s is not None and self._round_tokens:
            return self._round_s / self._round_tokens
        return self.verify_ms(batch, 1) / 1000.0 / max(batch, 1)

    def depth_seconds(self, batch: int) -> float:
        """Seconds one draft depth costs the batch (measured; before any, the calibrated deepest exit's)."""
        if self._depth_s is not None:
            return self._depth_s
        return self.costs.draft(batch) / 1000.0

    def fill_seconds(self) -> float:
        """Draft seconds per token a catch-up fills (measured; before any, `_fill_prior`)."""
        return self._fill_s if self._fill_s is not None else self._fill_prior()

    def _fill_prior(self) -> float:
        """A filled token costs the draft what the target's widest calibrated forward costs a token, in the draft's
        proportion of a step (prompt-like passes are compute-bound, so cost scales with layers as steps do)."""
        grid = self.costs.verify_ms
        b = max(grid)
        n = max(grid[b])
        share = self.costs.draft(1) / self.costs.verify(1, 1)
        return self.scale * share * self.costs.verify(b, n) / (b * n) / 1000.0

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
        explore = self.exploration.drafts(self.rounds, _bucket(batch), batch >= self.MEASURED_DRAFT_FROM, chosen,
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
        if not prompts and (self._timed(_bucket(batch), "nodraft") < self.MEASURED_AFTER
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

    def _timed(self, bucket: int, kind: str) -> int:
        """Decode rounds of `kind` timed in a batch-size bucket."""
        got = self._kinds.get((bucket, kind))
        return 0 if got is None else int(got[2])

    def measured_better(self, batch: int, kind: str, other: str) -> bool | None:
        """Whether `kind` rounds emitted tokens faster than `other` rounds at about this batch size, as measured; None
        until both have `MEASURED_AFTER` decode rounds there."""
        mine, theirs = self._token_s(batch, kind), self._token_s(batch, other)
        return None if mine is None or theirs is None else mine < theirs

    def _token_s(self, batch: int, kind: str) -> float | None:
        """Measured seconds per token of `kind` decode rounds at about this batch size; None until `MEASURED_AFTER`
        of them were timed there."""
        got = self._kinds.get((_bucket(batch), kind))
        return None if got is None or got[2] < self.MEASURED_AFTER else got[0] / got[1]

    def measured(self) -> dict[str, dict[str, float]]:
        """Measured ms per token of each kind of decode round by batch size bucket (for stats; `nodraft`: tree and
        plain rounds together, what rounds that do not draft yield)."""
        return {f"{b}/{name}": {"ms_per_token": 1000.0 * v[0] / v[1], "rounds": v[2]}
                for (b, name), v in sorted(self._kinds.items())}

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
        self.exploration.kept_nodes(_bucket(batch))
        return best_n

    def _unpriced(self, batch: int, offered: int) -> int:
        """Nodes to verify in a round whose `offered` nodes the budget keeps none of: 0, or all of them when
        `Exploration` says so (a CPU where two positions cost one and a half steps kept lookup off for good after a few
        rejected lookup nodes early in a run, where prompt lookup would have paid)."""
        if offered == 0:
            return 0
        return offered if self.exploration.verifies_idle_nodes(_bucket(batch)) else 0


def _bucket(batch: int) -> int:
    """Batch sizes that share measured round rates: 1-4 each, then powers of two (5-8, 9-16, ...)."""
    return batch if batch <= 4 else 1 << (batch - 1).bit_length()
