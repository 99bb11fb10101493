"""Differences of the server's cumulative clocks over one level: the router's rounds and calls (`timing` in
/stats) and the load-aware budget's account by kind of round (`spent`). Clocks report means and counts, so a level's
share is the difference of their products."""

from __future__ import annotations


def timing_delta(before: dict | None, after: dict | None) -> dict | None:
    """What one level added to the router's clocks: rounds and their mean ms, and per deployment (target, draft)
    its calls, their mean wall ms, the replica's ms, the difference (the price of the call itself) and the model
    thread's CPU ms (None where the server does not measure it)."""
    if not before or not after or "round" not in before or "round" not in after:
        return None
    total = lambda t, n, ms: t[n] * t[ms]  # noqa: E731  (the clocks report means; sums subtract)
    rounds = after["round"]["rounds"] - before["round"]["rounds"]
    if rounds <= 0:
        return None
    out: dict = {"rounds": rounds, "round_ms": (total(after["round"], "rounds", "mean_round_ms")
                                                 - total(before["round"], "rounds", "mean_round_ms")) / rounds}
    for role in ("target", "draft"):
        a, b = before.get(role), after.get(role)
        calls = (b["calls"] - a["calls"]) if a and b else 0
        if calls > 0:
            wall = total(b, "calls", "mean_call_ms") - total(a, "calls", "mean_call_ms")
            replica = total(b, "calls", "mean_replica_ms") - total(a, "calls", "mean_replica_ms")
            cpu = total(b, "calls", "mean_replica_cpu_ms") - total(a, "calls", "mean_replica_cpu_ms") \
                if "mean_replica_cpu_ms" in a and "mean_replica_cpu_ms" in b else 0.0
            out[role] = {"calls": calls, "call_ms": wall / calls, "replica_ms": replica / calls,
                         "overhead_ms": (wall - replica) / calls, "replica_cpu_ms": cpu / calls if cpu > 0 else None}
    spent = spent_delta((before.get("speculation") or {}).get("spent"), (after.get("speculation") or {}).get("spent"))
    if spent:
        out["spent"] = spent
    return out


def spent_delta(before: dict | None, after: dict | None) -> dict | None:
    """Per kind of round (prompt, draft, catch-up, tree, plain: the budget's `spent`), what one level added: rounds,
    seconds, tokens."""
    if not after:
        return None
    before = before or {}
    out = {}
    for kind, a in after.items():
        d = {k: a.get(k, 0) - before.get(kind, {}).get(k, 0) for k in ("rounds", "seconds", "tokens", "draft_seconds")}
        if d["rounds"] > 0:
            out[kind] = d
    return out or None
