"""Prefix routing of new sequences (no Ray): the placement is the same in every router, distinct prefixes spread,
the load bound holds, a placed sequence keeps its replica, and short prompts keep the home rule. The negative
control is the home rule itself: two routers send one prefix to two replicas, so each pays for it."""

from __future__ import annotations

from collections import Counter

from s2d_ray.serve.affinity import (
    Affinity, PrefixRoutingConfig, pin_of, place_new, preferred_order, prefix_key, split_by_replica,
)
from s2d_ray.serve.metrics import prefix_cache_totals

REPLICAS = ("r-a", "r-b")
SYSTEM = list(range(100, 164))  # 64 tokens shared by every prompt
ROUTING = PrefixRoutingConfig(block_tokens=32, max_imbalance=4)


def prompt(i: int) -> list[int]:
    return SYSTEM + [i, i + 1, i + 2]


def first_replica(aff: Affinity, seq: str, tokens: list[int], slot: tuple[int, int],
                  replicas: tuple[str, ...] = REPLICAS) -> str:
    key = aff.key_for(seq, tokens, len(tokens), replicas)
    return preferred_order(key, list(replicas), *slot)[0]


def test_two_routers_place_a_shared_prefix_on_one_replica_and_the_home_rule_does_not():
    routed = [Affinity(f"router{r}", "target-a", routing=ROUTING) for r in range(2)]
    homed = [Affinity(f"router{r}", "target-a") for r in range(2)]
    on = {first_replica(aff, f"s{r}", prompt(r), (r, 2)) for r, aff in enumerate(routed)}
    off = {first_replica(aff, f"s{r}", prompt(r), (r, 2)) for r, aff in enumerate(homed)}
    assert len(on) == 1  # both routers agree: the prefix is cached once
    assert off == set(REPLICAS)  # negative control: each router's home replica computes the prefix again


def test_placement_is_deterministic_and_distinct_prefixes_spread():
    assert prefix_key(SYSTEM, 32) == prefix_key(SYSTEM + [1], 32) and prefix_key(SYSTEM[:31], 32) is None
    assert prefix_key(SYSTEM, 32) != prefix_key([7] + SYSTEM, 32)
    four = ["r1", "r2", "r3", "r4"]
    placed = Counter(place_new(prefix_key([p] * 32, 32), four, {}, 4) for p in range(400))
    assert set(placed) == set(four) and min(placed.values()) > 60, placed  # ~100 each
    assert all(place_new(prefix_key([p] * 32, 32), four, {}, 4) == place_new(prefix_key([p] * 32, 32),
                                                                              list(reversed(four)), {}, 4)
               for p in range(50))  # the order replicas are listed in does not matter


def test_load_bound_sends_the_overflow_to_the_least_loaded_replica():
    aff = Affinity("router0", "target-a", routing=ROUTING)
    for i in range(12):
        first_replica(aff, f"s{i}", prompt(i), (0, 1))
        loads = aff.loads()
        assert max(loads.values()) - min(loads.get(r, 0) for r in REPLICAS) <= ROUTING.max_imbalance, loads
    assert sorted(aff.loads().values()) == [4, 8]  # the preferred replica keeps max_imbalance more, no more
    preferred = max(aff.loads(), key=aff.loads().get)
    for i in range(12):  # finished sequences free their place
        aff.forget(f"s{i}")
    assert aff.loads() == {} and first_replica(aff, "new", prompt(99), (0, 1)) == preferred


def test_a_placed_sequence_keeps_its_replica_and_short_prompts_keep_the_home_rule():
    aff = Affinity("router0", "target-a", routing=ROUTING)
    key = aff.key_for("s", prompt(0), len(prompt(0)), REPLICAS)
    where = pin_of(key)
    assert where in REPLICAS
    for extra in range(5):  # later rounds, the load elsewhere changed or not: same key, same replica
        assert aff.key_for("s", prompt(0) + [extra], len(prompt(0)) + 1, REPLICAS) == key
        assert preferred_order(key, list(REPLICAS), 1, 2)[0] == where  # whatever router slot ranks it
    assert split_by_replica([key], REPLICAS, (1, 2))[0][1] == [0]
    # only committed tokens count: draft tokens past a 10-token prompt do not make it a block long
    assert pin_of(aff.key_for("short", list(range(40)), 10, REPLICAS)) is None
    # a pinned replica that is gone: the next in the key's ranking
    assert preferred_order(key, ["r-c", "r-d"])[0] in ("r-c", "r-d")
    # placed while one replica was known: never pinned later (it would move the sequence's KV)
    assert pin_of(aff.key_for("lone", prompt(1), len(prompt(1)), ("r-a",))) is None
    assert pin_of(aff.key_for("lone", prompt(1), len(prompt(1)), REPLICAS)) is None
    off = Affinity("router0", "target-a", routing=PrefixRoutingConfig(enabled=False))
    assert pin_of(off.key_for("s", prompt(0), len(prompt(0)), REPLICAS)) is None


def test_prefix_counters_sum_each_replica_once():
    reps = [{"replica": "a", "prefix_cache_hits": 5, "prefix_cache_queries": 9},
            {"replica": "b", "prefix_cache_hits": 2, "prefix_cache_queries": 4},
            {"replica": "a", "prefix_cache_hits": 5, "prefix_cache_queries": 9}, {"error": "timeout"}]
    totals = prefix_cache_totals(reps)
    assert (totals["prefix_cache_hits"], totals["prefix_cache_queries"], totals["replicas"]) == (7, 13, 2)


def test_prefix_cache_budget_past_the_replica_memory_fails_at_deploy(tmp_path):
    """A budget the device cannot hold is refused naming prefix_cache.max_tokens; one that fits deploys."""
    import pytest

    from helpers import make_tiny_llama
    from s2d_ray.errors import ConfigError
    from s2d_ray.serve.app_config import AppConfig

    make_tiny_llama(vocab_size=64, num_layers=2, seed=0).save_pretrained(tmp_path)
    target = {"name": "t", "source": str(tmp_path), "dtype": "float32", "device_memory_gib": 0.001,
              "memory_fraction": 1.0, "max_live_sequences": 1}
    limits = {"max_total_tokens": 16, "max_tokens_limit": 8, "max_prompt_tokens": 8}
    fits = AppConfig(targets=[target], limits=limits, prefix_cache={"max_tokens": 64}, spec={"mode": "ar"})
    assert fits.prefix_cache.max_tokens == 64
    with pytest.raises((ConfigError, ValueError), match=r"prefix_cache\.max_tokens"):
        AppConfig(targets=[target], limits=limits, prefix_cache={"max_tokens": 10**7}, spec={"mode": "ar"})
