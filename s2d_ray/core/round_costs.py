"""What rounds cost, as this engine measured them: the per-round account the speculation budget decides by.

Every finished round (`RoundObservation`) updates moving averages of a round's seconds and tokens, a draft depth's
seconds, a caught-up token's draft seconds and the factor between measured and calibrated verification; whole decode
rounds are also timed by kind (drafted / lookup-only tree / plain, and `nodraft` for the last two) per batch-size
bucket, so that measured rates can overrule the cost model (`measured_better`). The decisions that use them are
core/budget.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from .costs import CostModel


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


class RoundCosts:
    """Measured costs of this engine's rounds, seeded by calibration (`costs`, None: nothing is priced).

    Verification costs are the calibrated grid times a factor learned from this engine's own decode rounds (`scale`:
    the grid was measured at one context length on an idle machine; long contexts, other load and a remote verifier's
    call overhead make real rounds dearer, and a budget that trusts the grid keeps drafting where it loses). Whole
    decode rounds are timed by kind per batch-size bucket and shown in the router's stats (`measured`,
    `spent_by_kind`).
    """

    MEASURED_AFTER = 3  # decode rounds of each kind at a batch size before their measured rates decide
    FILL_SAMPLE_TOKENS = 16  # a catch-up teaches the fill cost from this many filled tokens (fewer: mostly noise)

    def __init__(self, costs: CostModel | None) -> None:
        self.costs = costs
        self.rounds = 0
        # EMAs: seconds per round, tokens per round (whole batch), draft seconds per depth.
        self._round_s = self._round_tokens = self._depth_s = None
        self.scale = 1.0  # measured verify seconds over the grid's, EMA over decode rounds
        # (batch bucket, kind) -> [EMA seconds, EMA tokens, rounds] of whole decode rounds
        self._kinds: dict[tuple[int, str], list[float]] = {}
        # kind -> [rounds, seconds, tokens, draft seconds] of every round (prompt rounds and drafting rounds that
        # caught up too): where the time went, for stats; the choices use `_kinds`
        self.spent: dict[str, list[float]] = {}
        self._fill_s: float | None = None  # EMA: draft seconds per token a catch-up filled

    def spent_by_kind(self) -> dict[str, dict[str, float]]:
        """`spent` with named fields (rounds, seconds, tokens, draft_seconds) per kind of round, for stats."""
        return {kind: {"rounds": r, "seconds": s, "tokens": t, "draft_seconds": d}
                for kind, (r, s, t, d) in sorted(self.spent.items())}

    @staticmethod
    def _ema(old: float | None, new: float, alpha: float = 0.2) -> float:
        return new if old is None else (1 - alpha) * old + alpha * new

    def observe_round(self, obs: RoundObservation) -> None:
        """Learn from a finished round: its account by kind, the timed rates, and the costs it measured."""
        self.rounds += 1
        self._account(obs)
        if obs.batch and obs.tokens > 0:
            names = ("draft",) if obs.depth > 0 else ("tree" if obs.nodes > 0 else "plain", "nodraft")
            for name in names:
                kind = self._kinds.setdefault((batch_bucket(obs.batch), name), [obs.seconds, float(obs.tokens), 0.0])
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

    def verify_ms(self, batch: int, positions: int) -> float:
        """Modelled ms of verifying `batch` rows of `positions`: the calibrated grid times the learned factor."""
        return self.scale * self.costs.verify(batch, positions)

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
        got = self._kinds.get((batch_bucket(batch), kind))
        return None if got is None or got[2] < self.MEASURED_AFTER else got[0] / got[1]

    def measured(self) -> dict[str, dict[str, float]]:
        """Measured ms per token of each kind of decode round by batch size bucket (for stats; `nodraft`: tree and
        plain rounds together, what rounds that do not draft yield)."""
        return {f"{b}/{name}": {"ms_per_token": 1000.0 * v[0] / v[1], "rounds": v[2]}
                for (b, name), v in sorted(self._kinds.items())}


def batch_bucket(batch: int) -> int:
    """Batch sizes that share measured round rates: 1-4 each, then powers of two (5-8, 9-16, ...)."""
    return batch if batch <= 4 else 1 << (batch - 1).bit_length()
