"""Adapter affinity of new sequences (no Ray): a LoRA adapter's new sequences go to the replica that holds it resident
(as this router placed them), whatever their prompts; the record is an LRU bounded like the replica's slots; an
adapter no replica holds, or a holder over the load bound, goes to another replica (which then holds it too). The
negative control is the preference off: the same requests spread over the replicas."""

from __future__ import annotations

from s2d_ray.serve.affinity import (
    AdapterResidency, Affinity, PrefixRoutingConfig, pin_of, place_adapter, prefix_key,
)

REPLICAS = ("r-a", "r-b")
ROUTING = PrefixRoutingConfig(block_tokens=8, max_imbalance=4)


def prompt(i: int) -> list[int]:
    return [1000 + i] * 12  # distinct first blocks: prefix routing alone spreads them


def placed(aff: Affinity, seq: str, i: int, adapter: str, replicas: tuple[str, ...] = REPLICAS) -> str | None:
    return pin_of(aff.key_for(seq, prompt(i), len(prompt(i)), replicas, adapter))


def test_an_adapters_new_sequences_follow_the_replica_holding_it_and_spread_without_the_preference():
    on = Affinity("router0", "target-a", routing=ROUTING, adapters=AdapterResidency(max_loaded=2))
    off = Affinity("router0", "target-a", routing=ROUTING)
    first = placed(on, "s0", 0, "x")
    assert first in REPLICAS and on.adapters.resident() == {first: ["x"]}
    on.forget("s0")
    follow, spread = set(), set()
    for i in range(1, 17):  # one at a time (each finished before the next): loads stay equal
        follow.add(placed(on, f"s{i}", i, "x"))
        spread.add(placed(off, f"s{i}", i, "x"))
        on.forget(f"s{i}")
        off.forget(f"s{i}")
    assert follow == {first}
    assert spread == set(REPLICAS)  # negative control: prefix routing alone puts x on both replicas


def test_the_record_is_an_lru_bounded_like_the_replicas_slots_and_forgets_unloaded_adapters():
    held = AdapterResidency(max_loaded=2)
    for adapter in ("x", "y", "x", "z"):  # y is the least recently used when z arrives
        held.used("r-a", adapter)
    assert held.resident() == {"r-a": ["x", "z"]}
    assert held.holders("x", list(REPLICAS)) == ["r-a"] and held.holders("y", list(REPLICAS)) == []
    held.forget("x")
    assert held.resident() == {"r-a": ["z"]}


def test_later_rounds_keep_the_replica_and_refresh_the_adapter_there():
    aff = Affinity("router0", "target-a", adapters=AdapterResidency(max_loaded=1))  # prefix routing off
    where = placed(aff, "s", 0, "x")
    assert where in REPLICAS  # adapter affinity places LoRA rows with the prefix cache off too
    other = next(r for r in REPLICAS if r != where)
    aff.adapters.used(where, "y")  # the record says y evicted x there ...
    assert aff.key_for("s", prompt(0) + [5], len(prompt(0)) + 1, REPLICAS, "x").endswith(where)
    assert aff.adapters.resident() == {where: ["x"]}  # ... and x's next round there binds x again
    assert pin_of(aff.key_for("base-row", prompt(3), len(prompt(3)), REPLICAS, "")) is None  # base rows: home rule
    assert other not in aff.adapters.resident()


def test_a_holder_over_the_load_bound_or_no_holder_sends_the_sequence_to_another_replica():
    loads = {"r-a": 4, "r-b": 0}
    assert place_adapter("x", None, list(REPLICAS), loads, ["r-a"], 4) == "r-b"  # r-a is full: r-b loads x
    assert place_adapter("x", None, list(REPLICAS), {"r-a": 3}, ["r-a"], 4) == "r-a"
    # No holder: the adapter's (and prompt block's) ranking, the same in every router and for every order of ids.
    key = prefix_key(prompt(1), 8)
    assert place_adapter("x", key, ["r-a", "r-b"], {}, [], 4) == place_adapter("x", key, ["r-b", "r-a"], {}, [], 4)
    firsts = {place_adapter(f"ad{i}", None, list(REPLICAS), {}, [], 4) for i in range(16)}
    assert firsts == set(REPLICAS)  # different adapters start on different replicas
    aff = Affinity("router0", "target-a", routing=ROUTING, adapters=AdapterResidency(max_loaded=2))
    homes = [placed(aff, f"s{i}", i, "x") for i in range(12)]  # all live at once
    assert sorted(aff.loads().values()) == [4, 8] and set(homes) == set(REPLICAS)
    assert aff.adapters.holders("x", list(REPLICAS)) == list(REPLICAS)  # both now hold x
