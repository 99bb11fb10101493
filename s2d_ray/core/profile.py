"""Where an engine's rounds spend their time: draft, verification, prompt filling and the host work between them.

Every round is split into the drafter's call (lookup included), the verifier's call, and the rest (planning, tree
shaping, acceptance, commit: host work); a round whose verification carried prompt positions counts that call as
prompt time, since a prompt's cost is not verification's. Rounds are kept apart by kind (`speculative`: some row
verified draft or lookup tokens; `plain`: none did), so the remaining gap between S2D and plain decoding at a load
shows as seconds per token by part.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PARTS = ("draft", "verify", "prompt", "host")


@dataclass
class RoundProfile:
    """Seconds by part and kind of round, summed over the engine's rounds."""

    totals: dict[str, dict[str, float]] = field(default_factory=dict)  # kind -> rounds, tokens, seconds, parts

    def add(self, kind: str, tokens: int, seconds: float, draft: float, verify: float, prompt: bool) -> None:
        """One finished round: its wall seconds, the drafter's and verifier's shares, whether it carried a prompt."""
        t = self.totals.setdefault(kind, dict.fromkeys(("rounds", "tokens", "seconds", *PARTS), 0.0))
        t["rounds"] += 1
        t["tokens"] += tokens
        t["seconds"] += seconds
        t["draft"] += draft
        t["prompt" if prompt else "verify"] += verify
        t["host"] += max(seconds - draft - verify, 0.0)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per kind: rounds, tokens, seconds, and ms per token of each part (what the stats and benchmarks show)."""
        out = {}
        for kind, t in sorted(self.totals.items()):
            per = 1000.0 / t["tokens"] if t["tokens"] else 0.0
            out[kind] = {"rounds": int(t["rounds"]), "tokens": int(t["tokens"]), "seconds": t["seconds"],
                         "ms_per_token": t["seconds"] * per, **{f"{p}_ms_per_token": t[p] * per for p in PARTS}}
        return out

    def since(self, before: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        """The totals added since a `snapshot` (one benchmark level), summarised."""
        delta = RoundProfile()
        for kind, t in self.totals.items():
            old = before.get(kind, {})
            delta.totals[kind] = {k: v - old.get(k, 0.0) for k, v in t.items()}
        delta.totals = {k: t for k, t in delta.totals.items() if t["rounds"] > 0}
        return delta.summary()

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {kind: dict(t) for kind, t in self.totals.items()}
