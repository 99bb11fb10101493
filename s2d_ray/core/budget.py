"""How much to speculate this round: tree shape from configuration, size from measured costs and acceptance.

Round time ~= verify(B, n) + depth * draft(B); tokens per row ~= 1 + sum over verified nodes of P(node accepted).
With a cost model (calibration) the engine picks, every round, the draft depth that maximises modelled tokens per
second for the whole batch, then keeps the best n nodes per row for the same reason (n = 0 is plain decoding). As the
batch grows, verify(B, n) grows with B * n and the same rule shrinks trees to nothing; it grows them back when load
drops. Acceptance probabilities are learned online from this engine's own rounds (priors only until data arrives).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .costs import CostModel
from .tree import LOOKUP, TokenTree, is_lookup

SCORE_EDGES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.01)  # upper edges of draft-score bins
MAX_LOOKUP_DEPTH = 32


@dataclass(frozen=True)
class TreeShape:
    """What a tree may hold: `width` draft candidates per node, lookup candidates, at most `max_nodes` nodes;
    `frontier`: nodes the draft expands per depth (1: the top-1 spine, its siblings stay leaves)."""

    width: int = 1
    lookup: bool = False
    max_nodes: int = 24
    frontier: int = 1


class AcceptanceModel:
    """P(the path to a node is accepted), by the node's draft path probability (binned) or its lookup depth (the
    first continuation by the length of the suffix it matched, and the other, older occurrences' branches apart).

    Counts start from priors worth `prior_weight` observations (draft: 0.8 x the bin's score; lookup: LOOKUP_PRIORS;
    branches 0.15 x 0.7^d), then follow what this engine's rounds accepted.
    """

    # Matched suffix length (1..4, 4 = longer too; 0 = not recorded) -> (P(first token accepted), ratio per deeper
    # token). A continuation after a 4-token match is right ~0.9 of the time, after a 1-token match ~0.3: one
    # estimate for both kept the 1-token matches' nodes where they cost more than they yield, or dropped the 4-token
    # ones where they pay (offline replay on the held-out greedy paths of both targets: 0.28-0.32 / 0.49-0.52 /
    # 0.51-0.61 / 0.87-0.95 at depth 1; modelled lookup-only rounds +4-9% tokens per cost where width is dear).
    LOOKUP_PRIORS = ((0.5, 0.8), (0.3, 0.65), (0.5, 0.7), (0.55, 0.7), (0.9, 0.87))

    def __init__(self, prior_weight: float = 4.0) -> None:
        lows = (0.0,) + SCORE_EDGES[:-1]
        centres = [(lo + min(hi, 1.0)) / 2 for lo, hi in zip(lows, SCORE_EDGES)]
        self.draft = [[0.8 * c * prior_weight, prior_weight] for c in centres]  # [accepted, offered] per bin
        # [matched suffix length bucket][depth - 1] -> [accepted, offered]
        self.lookup = [[[p * r ** d * prior_weight, prior_weight] for d in range(MAX_LOOKUP_DEPTH)]
                       for p, r in self.LOOKUP_PRIORS]
        self.branch = [[0.15 * 0.7 ** d * prior_weight, prior_weight] for d in range(MAX_LOOKUP_DEPTH)]

    @staticmethod
    def _bin(score: float) -> int:
        return min(bisect.bisect_right(SCORE_EDGES, score), len(SCORE_EDGES) - 1)

    def _lookup_cell(self, exit_layer: int, depth: int, ngram: int = 0) -> list[float]:
        d = min(depth, MAX_LOOKUP_DEPTH) - 1
        if exit_layer != LOOKUP:
            return self.branch[d]
        return self.lookup[min(max(ngram, 0), len(self.lookup) - 1)][d]

    def _lookup_p(self, exit_layer: int, depth: int, ngram: int = 0) -> float:
        acc, off = self._lookup_cell(exit_layer, depth, ngram)
        return acc / off

    def estimate(self, tree: TokenTree) -> list[float]:
        depths = tree.depths()
        est = []
        for ex, score, d in zip(tree.exits, tree.scores, depths):
            a, o = self.draft[self._bin(score)]
            p = a / o if score > 0 else 0.0
            if is_lookup(ex):
                p = max(p, self._lookup_p(ex, d, tree.match_ngram))
            est.append(p)
        # A node is never likelier than its parent (the path must be accepted first).
        for i, par in enumerate(tree.parents):
            if par >= 0:
                est[i] = min(est[i], est[par])
        return est

    def score_for(self, p: float) -> float:
        """The lowest draft path probability whose bin is accepted with probability >= p (1.01: none is)."""
        lows = (0.0,) + SCORE_EDGES[:-1]
        for lo, (acc, off) in zip(lows, self.draft):
            if acc / off >= p:
                return lo
        return SCORE_EDGES[-1]

    def observe(self, tree: TokenTree, path: list[int]) -> None:
        on_path = set(path)
        for i, (ex, score, d) in enumerate(zip(tree.exits, tree.scores, tree.depths())):
            hit = float(i in on_path)
            if score > 0:
                cell = self.draft[self._bin(score)]
                cell[0] += hit
                cell[1] += 1
            if is_lookup(ex):
                cell = self._lookup_cell(ex, d, tree.match_ngram)
                cell[0] += hit
                cell[1] += 1


@dataclass(frozen=True)
class RoundPlan:
    """What the drafter is asked for this round: the spine's depth cap and the path probability below which a
    row stops drafting deeper (EAGLE-2's dynamic depth; 0 = always draft `depth` deep)."""

    depth: int
    min_score: float = 0.0
    hold: frozenset[int] = frozenset()  # rows (indices into the plan's `rows`) that do not draft this round


class SpeculationBudget:
    """Per round: how deep to draft and how many nodes each row keeps, from measured costs when there are some.

    Without costs: the policy's k and `max_nodes`. With costs (policy `auto`), everything is priced in seconds per
    token of the whole batch, measured online and seeded by calibration:
    - verification costs are the calibrated grid times a factor learned from this engine's own decode rounds (the
      grid was measured at one context length on a quiet machine; long contexts, other load and a remote verifier's
      call overhead make real rounds dearer, and a budget that trusts the grid keeps drafting where it loses);
    - the draft runs at all only while a first depth pays for its whole cost: (1 + hit) * verify(B, 1) >
      verify(B, 2) + draft depth (re-checked now and then, so speculation comes back when load drops), and from
      5 rows only while whole drafting rounds, once timed, yield tokens faster than rounds without the draft
      (there a re-check drafts two rounds, the second timed, and comes half as often each time drafting still loses;
      and while the model drafts, rounds without the draft are timed first and one round in 16 after, so that the
      comparison exists whichever kind the run started with);
    - a row drafts one depth deeper while its spine's path probability, mapped to acceptance, is worth more than the
      depth costs: P(accept) * t_token > c_draft(B) / B (t_token: the batch's measured seconds per token);
    - after drafting, each row keeps the n best nodes, n chosen for the best modelled tokens per verification second
      (n = 0 is a plain decoding step);
    - in a round that does not draft, once this engine has timed enough decode rounds of both kinds at about this
      batch size, lookup-only tree rounds are kept only while their measured seconds per token beat plain rounds'
      (one round in 16 tries the other): the model prices nodes against one plain step, where a served plain round
      takes several steps per target call and pays one call overhead for them.
    Whole decode rounds are timed by kind (drafted / lookup-only tree / plain, and `nodraft` for the last two) per
    batch-size bucket and shown in the router's stats; a drafting round counts only when its drafting rows drafted
    the round before or are new to the draft (the engine says so): the first one after a pause also catches the draft
    up on every token since, but filling a joining sequence's prompt is what drafting costs while sequences come and
    go (timing warm rounds alone, served 8 rows drafted 26 rounds at 33 ms a token and caught up in 17 more, where
    rounds without the draft took 26-27: session 23);
    - a row the draft has not seen lately (new, or back after rounds without the draft) drafts only if its catch-up
      pays: the tokens the draft must fill first x the draft's measured seconds per filled token, against what the
      row's remaining tokens gain from drafting (measured drafting rounds against plain ones at this batch size, else
      the first depth's modelled saving); an exploration round, or any row, may spend up to a row's share of one plain
      step on it (from 2 rows: `CATCH_UP_FROM`). Served, the draft's catch-ups were the whole of S2D's loss at 8 rows
      (5-9 s a level, mostly rows of 300 tokens caught up with 10-30 left as the level drained to 1-4 rows; session
      23).
    """

    EXPLORE_EVERY = 16  # a drafting (when modelled not to pay) or lookup-vs-plain exploration round this often
    MEASURED_AFTER = 3  # decode rounds of each kind at a batch size before their measured rates decide
    # From this many rows, measured rounds also veto drafting the model would do: served at 8 rows, runs that drafted
    # in most rounds lost to plain decoding (0.94-0.99x) where runs that drafted in few won (BENCHMARKS.md §3, session
    # 9). Below it they do not: there the rounds that skip the draft are mostly lookup-alone rounds, chosen because a
    # prompt-lookup match proposes well, so they look cheaper per token than drafting is (deciding by them lost 4-9%
    # at batch 1, session 7).
    MEASURED_DRAFT_FROM = 5
    # There, while drafting is not chosen, exploring it is a pair of rounds (the catch-up, then a timed one) whose gap
    # doubles from EXPLORE_EVERY up to this many times it: at a steady 8 rows each pair cost ~150 ms of catch-up and
    # wide verification for nothing (BENCHMARKS.md §3, session 10).
    EXPLORE_BACKOFF = 16
    # And no such pair starts in a round that fills a prompt, nor ends on one: a prompt round is never timed (it costs
    # what the prompt costs), so a pair there paid its catch-up for nothing; it waits for the next decode round.

    def __init__(self, shape: TreeShape, costs: CostModel | None, max_depth: int) -> None:
        self.shape, self.costs, self.max_depth = shape, costs, max_depth
        self.acceptance = AcceptanceModel()
        self.rounds = 0
        # EMAs: seconds per round, tokens per round (whole batch), draft seconds per depth, first-depth draft hits.
        self._round_s = self._round_tokens = self._depth_s = None
        self._first_hit = [0.5 * 4.0, 4.0]  # [accepted, rounds] of depth-1 draft nodes, prior 0.5
        self.scale = 1.0  # measured verify seconds over the grid's, EMA over decode rounds
        # (batch bucket, kind) -> [EMA seconds, EMA tokens, rounds] of whole decode rounds
        self._kinds: dict[tuple[int, str], list[float]] = {}
        # kind -> [rounds, seconds, tokens, draft seconds] of every round (prompt rounds and drafting rounds that caught up too): where
        # the time went, for stats; the choices use `_kinds`
        self.spent: dict[str, list[float]] = {}
        self._drafting = False  # this round's plan drafts
        self._explore_gap: dict[int, int] = {}  # batch bucket (>= MEASURED_DRAFT_FROM rows) -> rounds between explorations
        self._explore_second: int | None = None  # the bucket whose exploration's timed second round is next
        self._explore_due: int | None = None  # the bucket whose exploration waits for a round without a prompt
        self._idle_nodes: dict[int, tuple[int, int]] = {}  # batch bucket -> (rounds offered nodes and kept none, gap)
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

    def observe_round(self, seconds: float, tokens: int, draft_seconds: float, depth: int,
                      verify: tuple[float, int, int] | None = None, batch: int | None = None,
                      nodes: int = 0, prompt: bool = False, warm: bool = True, filled: int = 0) -> None:
        """A finished round of the whole batch: wall seconds, tokens emitted, draft seconds and the depth drafted;
        `verify` = (seconds, batch, positions) of its verification when it was a one-step decode round (no prompt);
        `batch` = its rows when the round is fit to time a kind of round by (no row filled a prompt, and every
        drafting row drafted the round before or is new to the draft: the first draft after a pause catches up on
        every token since, but filling a joining sequence's prompt is what drafting costs as sequences come and go),
        else None; `nodes`: the most tree nodes a row verified; `prompt`: a row filled its prompt; `warm`: every
        drafting row drafted the round before (the draft's time is its depths only); `filled`: tokens the draft caught
        up on for rows that did not (their draft time beyond the depths is what a filled token costs)."""
        self.rounds += 1
        kind = "prompt" if prompt else ("draft" if batch and warm else "catch-up") if depth > 0 else \
            ("tree" if nodes > 0 else "plain")
        spent = self.spent.setdefault(kind, [0, 0.0, 0, 0.0])
        spent[0], spent[1], spent[2], spent[3] = spent[0] + 1, spent[1] + seconds, spent[2] + tokens, \
            spent[3] + draft_seconds
        if batch and tokens > 0:
            names = ("draft",) if depth > 0 else ("tree" if nodes > 0 else "plain", "nodraft")
            for name in names:
                kind = self._kinds.setdefault((_bucket(batch), name), [seconds, float(tokens), 0.0])
                kind[0], kind[1] = self._ema(kind[0], seconds), self._ema(kind[1], float(tokens))
                kind[2] += 1
        self._round_s = self._ema(self._round_s, seconds)
        self._round_tokens = self._ema(self._round_tokens, float(tokens))
        # A draft depth's cost is learned from warm drafting rounds only: a prompt round's draft time is mostly the
        # draft filling the prompt, and a catch-up round's (the first draft after plain rounds, or a joining
        # sequence's) mostly the draft catching up on every token since. Counting catch-ups put one depth at 27-36 ms
        # where it costs 6-9 (fp32 here), and the budget then never drafted again to correct it (session 22).
        if depth > 0 and verify is not None and batch and warm:
            self._depth_s = self._ema(self._depth_s, draft_seconds / depth)
        if depth > 0 and not prompt and filled >= self.FILL_SAMPLE_TOKENS and self.costs is not None:
            prior = self._fill_prior()
            rows = verify[1] if verify is not None else batch or 1
            per_token = max(draft_seconds - depth * self.depth_seconds(rows), 0.0) / filled
            self._fill_s = self._ema(self._fill_s, min(max(per_token, 0.1 * prior), 10.0 * prior))
        if verify is not None and self.costs is not None:
            v_s, batch, positions = verify
            self.scale = self._ema(self.scale, min(max(1000.0 * v_s / self.costs.verify(batch, positions), 0.25), 8.0))

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
    FILL_SAMPLE_TOKENS = 16  # a catch-up teaches the fill cost from this many filled tokens (fewer: mostly noise)
    # Catch-ups are priced from this many rows. At one row the only catch-up is a request's own prompt right after its
    # prefill, held or drafted for the whole request on one comparison of one-row rounds, and that comparison misled
    # served: the router timed its one-row drafting rounds at 86-118 ms a token against plain rounds' 72-81, so the
    # rule held nearly every prompt out of the draft, and S2D / AR at one row measured 0.80-1.11 (four runs) against
    # 1.03-1.13 drafting every prompt (lookup merged into the draft's trees is what pays there; session 24).
    CATCH_UP_FROM = 2

    def plan(self, batch: int, default_depth: int, prompts: int = 0,
             rows: list[tuple[int, int] | None] | None = None) -> RoundPlan:
        """This round's draft depth and node threshold for `batch` rows, `prompts` of which fill their prompt; `rows`:
        per row that may draft, (tokens the draft must catch up on first, tokens the row may still emit), None for a
        row that may not (RoundPlan.hold: those whose catch-up does not pay)."""
        if self.costs is None:
            return RoundPlan(default_depth)
        if self.shape.width < 1 or self.max_depth < 1:
            return RoundPlan(0)
        needed = min(max(self.depth_seconds(batch) / (max(batch, 1) * self.token_seconds(batch)), 0.02), 0.95)
        hit = self._first_hit[0] / self._first_hit[1]
        # Drafting pays only if a row's first node, at its hit rate, buys more tokens than its verification width and
        # the draft forward cost the whole batch (re-checked now and then: acceptance and load change).
        self._drafting = False
        v1, v2 = self.verify_ms(batch, 1), self.verify_ms(batch, 2)
        if (1 + hit) * v1 <= v2:  # not even free drafts would pay at this batch size
            return RoundPlan(0)
        # The draft's own choice is modelled; from MEASURED_DRAFT_FROM rows measured rounds may veto it (not below:
        # deciding it by measured rounds at batch 1, tried in session 7, drafted less and lost 4-9% on Spec-Bench).
        bucket, gated = _bucket(batch), batch >= self.MEASURED_DRAFT_FROM
        gap = self._explore_gap.get(bucket, self.EXPLORE_EVERY) if gated else self.EXPLORE_EVERY
        second, self._explore_second = self._explore_second == bucket, None
        due, self._explore_due = self._explore_due == bucket, None
        explore = second or due or self.rounds % gap == 0
        draft = (1 + hit) * v1 > v2 + 1000.0 * self.depth_seconds(batch)
        if draft and gated:
            if self.measured_better(batch, "draft", "nodraft") is False:
                draft = False  # whole drafting rounds measured slower per token than rounds without the draft
            elif not prompts and (self._timed(bucket, "nodraft") < self.MEASURED_AFTER
                                  or self.rounds % self.EXPLORE_EVERY == 0):
                # The model drafts, but rounds without the draft were never (or not lately) timed at this size, so
                # nothing could veto it: a run that drafted from its first round at 8 rows kept drafting at 26 ms a
                # token where lookup-only rounds took 13-15 (BENCHMARKS.md §3, session 13). Time one (a decode round).
                self._drafting = False
                return RoundPlan(0)
        chosen = draft
        if gated and draft:
            self._explore_gap.pop(bucket, None)
        elif gated and explore and prompts:  # untimed: a pair waits; its second round drafts (keeps rows warm) and waits
            self._explore_second, self._explore_due = (bucket, None) if second else (None, bucket)
            explore = second
        elif gated and explore and not second:
            # The draft's first round after a pause catches up on every token since (at 8 rows, hundreds) and is not
            # timed: explore two rounds so the second is (a veto can lift), half as often each time it did not.
            self._explore_gap[bucket] = self._backed_off(gap)
            self._explore_second = bucket
        draft = draft or explore
        hold: frozenset[int] = frozenset()
        if draft and rows and batch >= self.CATCH_UP_FROM:
            hold = self._unpaid_catch_ups(rows, batch, self._token_gain_ms(batch, v1, v2, hit) if chosen else 0.0, v1)
            draft = any(r is not None and i not in hold for i, r in enumerate(rows))
        self._drafting = draft
        return RoundPlan(self.max_depth, self.acceptance.score_for(needed), hold) if draft else RoundPlan(0)

    def _token_gain_ms(self, batch: int, v1: float, v2: float, hit: float) -> float:
        """What drafting saves per token emitted at this batch size, ms: measured (plain rounds' ms a token less
        drafting rounds') once both kinds are timed here, else the first depth's modelled saving per round over the
        (1 + hit) tokens a row emits in one. Plain rounds, not all rounds without the draft: a row held out of the draft
        still gets lookup-alone rounds where its match is long, so those are no part of what drafting changes; the
        first depth alone undervalued drafting at one row (fp32 here: 69 against 87 ms a token measured, the model
        ~0), holding out the long prompts' draft for good."""
        drafting, plain = self._token_s(batch, "draft"), self._token_s(batch, "plain")
        if drafting is not None and plain is not None:
            return max(1000.0 * (plain - drafting), 0.0)
        saved = (1 + hit) * v1 - v2 - 1000.0 * self.depth_seconds(batch)
        return max(saved, 0.0) / (max(batch, 1) * (1 + hit))

    def _unpaid_catch_ups(self, rows: list[tuple[int, int] | None], batch: int, gain_ms: float,
                          v1: float) -> frozenset[int]:
        """Rows whose catch-up costs more than drafting can gain them: `gain_ms` a remaining token (0 in an
        exploration), or at least a row's share of one plain step (what a round may spend to keep acceptance
        measured)."""
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

    def _backed_off(self, gap: int) -> int:
        """The next gap between explorations that keep not paying: doubled, at most EXPLORE_BACKOFF x EXPLORE_EVERY."""
        return min(2 * gap, self.EXPLORE_EVERY * self.EXPLORE_BACKOFF)

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
        tokens per verification second; 0 means a plain decoding step."""
        cap = self.shape.max_nodes
        if self.costs is None:
            return cap
        batch = max(len(estimates), 1)
        widest = min(cap, max((len(e) for e in estimates), default=0))
        if not self._drafting:  # lookup-only trees or plain rounds: measured once both are (one round in 16 explores)
            trees = self.measured_better(batch, "tree", "plain")
            if trees is not None and self.rounds % self.EXPLORE_EVERY == self.EXPLORE_EVERY // 2:
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
        self._idle_nodes.pop(_bucket(batch), None)
        return best_n

    def _unpriced(self, batch: int, offered: int) -> int:
        """Nodes to verify in a round whose offered nodes the budget keeps none of: usually 0, but every
        EXPLORE_EVERY-th such round at a batch size all of them. Unverified nodes teach the acceptance model nothing,
        so estimates that a few unlucky rounds pushed below the pay line (or a measured round rate) would stay there
        for good: on a CPU where two positions cost 1.5 one-row steps, 44 rejected lookup nodes in the first answer
        of a Spec-Bench run kept lookup off for the other 13, where transformers' prompt lookup gained 10% on the
        same outputs (BENCHMARKS.md §0, session 18). The gap doubles, up to EXPLORE_BACKOFF times, while the budget
        still keeps no nodes after an exploration; it resets once it keeps some."""
        if offered == 0:
            return 0
        bucket = _bucket(batch)
        since, gap = self._idle_nodes.get(bucket, (0, self.EXPLORE_EVERY))
        if since + 1 < gap:
            self._idle_nodes[bucket] = (since + 1, gap)
            return 0
        self._idle_nodes[bucket] = (0, self._backed_off(gap))
        return offered


def _bucket(batch: int) -> int:
    """Batch sizes that share measured round rates: 1-4 each, then powers of two (5-8, 9-16, ...)."""
    return batch if batch <= 4 else 1 << (batch - 1).bit_length()
