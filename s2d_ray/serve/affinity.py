"""Replica affinity: a sequence's rounds (propose, score, release) go to the replica that holds its KV. No Ray at
import (the router's clients and scheduler use this; the Serve request router is `affinity_router`).

Each sequence's key is its router's key plus its sequence id. Router replica r of n (Serve's replica rank and world
size) has home replicas among a deployment's R live replicas (sorted ids): replica r mod R when n >= R (routers spread
one to a replica: each keeps whole rounds, so forwards stay as large as its batch), else every replica j with
j mod n == r (one router's sequences spread over the replicas no other router has). A sequence prefers the home
replica its key ranks highest by rendezvous hashing, then the others by the same hash (`preferred_order`, also what
`affinity_router.SequenceAffinityRouter` ranks each call by). A round is one call per preferred replica, each call
carrying a key of one of its members (all prefer that replica). When the preferred replica is gone, draining, or its
queue is full, the next in the ranking takes the call and rebuilds the sequence from its token prefix (always correct;
counted as `s2d_recomputed_tokens_total`).

Why not one key per router: hashed onto replicas, replicas idle with fewer routers than replicas and two routers can
land on one replica. Why not every sequence hashed over all replicas: each router's batch would split over replicas
other routers also use, so forwards carry fewer rows (RELIABILITY.md, "Scaling out").

Prefix routing (`router.prefix_routing`) places a NEW sequence instead by the prompt it starts with, so that requests
sharing a prefix (a system prompt, an earlier turn of a chat) land on the replica whose prefix cache holds it: the
replica its first `block_tokens` prompt tokens rank highest by rendezvous hashing over ALL live replicas, unless this
router already keeps `max_imbalance` more live sequences there than on its least loaded replica; then the next in that
ranking under the bound. Every router ranks alike (the hash of the tokens and the replica ids; no shared state), so
two routers send a prefix to one replica. The choice is pinned into the sequence's key (`pinned`), so its later rounds
stay there as before, whatever the load does meanwhile. A prompt shorter than a block (too short to be cached) keeps
the home rule. Ray's own `PrefixCacheAffinityRouter` does not fit: it routes whole requests by their text through a
shared tree actor, where a call here is one round of many sequences, each already bound to its replica.

Adapter affinity (`router.prefix_routing.adapter_affinity`, targets with `lora:`) places a new sequence of a LoRA
adapter on a replica that keeps that adapter resident in its stacked slots, so a round's forward does not evict and
copy in adapters: this router records, per replica, the adapters of the sequences it keeps there, least recently used
first, bounded like the replica's slots (`lora.max_loaded`; `AdapterResidency`). Among the replicas holding the
adapter the sequence goes where its adapter and prompt block hash (prefix affinity within the adapter: KV computed
under one adapter serves only that adapter), under the same load bound; when none holds it, or all are over the
bound, the next replica in that ranking takes it and loads the adapter (every replica registers every adapter, so any
replica serves any adapter; the record only steers, it is never needed for a correct answer).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter, OrderedDict
from typing import Any, Awaitable, Callable

from pydantic import BaseModel, ConfigDict, Field

from ..core.rows import common_prefix

PIN = "|pin="  # in a sequence's key: the replica it was placed on (replica ids and sequence keys never hold it)


class PrefixRoutingConfig(BaseModel):
    """Where a router sends a new sequence (module docstring): by its prompt's first block, within a load bound."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Place each new sequence on the replica (of the target and of the draft) "
                          "its prompt's first block hashes to, where earlier prompts sharing that block left their "
                          "prefix in the cache; false: the router's home replicas, as for short prompts.")
    block_tokens: int = Field(32, ge=1, description="Prompt tokens hashed (shorter prompts keep the home rule): "
                              "the prefix cache keeps no row shorter than 32, and a longer block tells apart prompts "
                              "that share only a chat template's header.")
    max_imbalance: int = Field(4, ge=1, description="A router places a new sequence elsewhere once it keeps this many "
                               "more live sequences on the preferred replica than on its least loaded one (per "
                               "deployment): the bound on how unevenly one popular prefix loads the replicas.")
    adapter_affinity: bool = Field(True, description="Place a new sequence of a LoRA adapter on a replica of its "
                                   "target that keeps the adapter resident (as this router last placed sequences; "
                                   "within max_imbalance), else where its adapter and prompt block hash; false: LoRA "
                                   "rows are placed like any other row. Applies with the prefix cache off too.")


def rendezvous_rank(key: str, replica_ids: list[str]) -> list[str]:
    """Replica ids, most preferred first (highest random weight): adding or removing a replica moves only the keys
    that preferred it."""
    def weight(rid: str) -> bytes:
        return hashlib.blake2b(f"{key}|{rid}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


def home_replicas(replica_ids: list[str], rank: int, routers: int) -> list[str]:
    """The replicas router `rank` of `routers` keeps its sequences on (see the module docstring)."""
    ids = sorted(replica_ids)
    if not ids:
        return []
    if routers >= len(ids):
        return [ids[rank % len(ids)]]
    return [rid for j, rid in enumerate(ids) if j % routers == rank % routers]


def pinned(key: str, replica: str) -> str:
    """A sequence key that prefers `replica` first (while it is live)."""
    return f"{key}{PIN}{replica}"


def pin_of(key: str) -> str | None:
    return key.rpartition(PIN)[2] if PIN in key else None


def prefix_key(tokens: list[int], block: int) -> str | None:
    """A stable digest of the first `block` tokens (None when there are fewer): equal in every process."""
    if len(tokens) < block:
        return None
    return hashlib.blake2b(",".join(map(str, tokens[:block])).encode(), digest_size=8).hexdigest()


def place_new(prefix: str, replica_ids: list[str], loads: dict[str, int], max_imbalance: int) -> str:
    """The replica for a new sequence with this prefix key: the first in its rendezvous ranking whose load (live
    sequences this router keeps there) is under the least loaded replica's plus `max_imbalance`."""
    floor = min(loads.get(r, 0) for r in replica_ids)
    return next(r for r in rendezvous_rank(prefix, replica_ids) if loads.get(r, 0) < floor + max_imbalance)


class AdapterResidency:
    """One router's record of the adapters each replica of a LoRA target keeps resident (module docstring): per
    replica, the adapters of the sequences this router placed or kept there, least recently used first, at most the
    replica's `max_loaded` slots (what its LoraBank keeps). Other routers' rows also use the slots, so the record can
    be stale; it only steers placement."""

    def __init__(self, max_loaded: int) -> None:
        self.max_loaded = max_loaded
        self._held: dict[str, OrderedDict[str, None]] = {}

    def used(self, replica: str, adapter: str) -> None:
        """A round of `adapter` rows goes to `replica`: it binds the adapter there, evicting its least recently
        used beyond `max_loaded`."""
        held = self._held.setdefault(replica, OrderedDict())
        held[adapter] = None
        held.move_to_end(adapter)
        while len(held) > self.max_loaded:
            held.popitem(last=False)

    def holders(self, adapter: str, replica_ids: list[str]) -> list[str]:
        return [r for r in replica_ids if adapter in self._held.get(r, ())]

    def resident(self) -> dict[str, list[str]]:
        """Replica -> adapters, least recently used first."""
        return {r: list(held) for r, held in self._held.items()}

    def forget(self, adapter: str) -> None:
        """The adapter was unloaded: no replica holds it any more."""
        for held in self._held.values():
            held.pop(adapter, None)


def place_adapter(adapter: str, prefix: str | None, replica_ids: list[str], loads: dict[str, int],
                  holders: list[str], max_imbalance: int) -> str:
    """The replica for a new sequence of `adapter` (module docstring): the replicas holding it first, each group in
    the rendezvous ranking of the adapter and the prompt's block key (`prefix`, None for a short prompt), the first
    whose load is under the least loaded replica's plus `max_imbalance`."""
    ranked = rendezvous_rank(f"lora={adapter}|{prefix or ''}", replica_ids)
    order = [r for r in ranked if r in holders] + [r for r in ranked if r not in holders]
    floor = min(loads.get(r, 0) for r in replica_ids)
    return next(r for r in order if loads.get(r, 0) < floor + max_imbalance)


def preferred_order(key: str, replica_ids: list[str], rank: int = 0, routers: int = 1) -> list[str]:
    """Replica ids, most preferred first: a pinned key's replica, else the router's home replicas by rendezvous
    hashing of the key; then the rest."""
    pin = pin_of(key)
    if pin in replica_ids:
        return [pin] + rendezvous_rank(key, [r for r in replica_ids if r != pin])
    home = home_replicas(replica_ids, rank, routers)
    return rendezvous_rank(key, home) + rendezvous_rank(key, [r for r in replica_ids if r not in home])


def router_slot() -> tuple[int, int]:
    """(rank, world size) of this process's Serve replica (a router replica); (0, 1) outside a replica."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
    except Exception:  # not inside a Serve replica (tests, a driver)
        return 0, 1
    rank = getattr(ctx.rank, "rank", ctx.rank)
    return int(rank or 0), max(int(getattr(ctx, "world_size", 1) or 1), 1)


# (app, deployment) -> live replica ids, as this process's request routers last saw them
_LIVE: dict[tuple[str, str], tuple[str, ...]] = {}


def publish_replicas(deployment_id: Any, replica_ids: list[str]) -> None:
    """Called by `affinity_router.SequenceAffinityRouter` whenever Serve updates its replica set."""
    _LIVE[(deployment_id.app_name, deployment_id.name)] = tuple(sorted(replica_ids))


def live_replicas(handle: Any) -> tuple[str, ...] | None:
    """The replica ids the handle's request router last saw (() before its first update); None for a handle that
    is not a Serve deployment handle (tests' local stand-ins: one call, as one replica)."""
    dep = getattr(handle, "deployment_id", None)
    return None if dep is None else _LIVE.get((dep.app_name, dep.name), ())


def sequence_key(router_key: str | None, seq_id: str) -> str | None:
    return None if router_key is None else f"{router_key}/{seq_id}"


def split_by_replica(keys: list[str | None], replica_ids: tuple[str, ...] | None,
                     slot: tuple[int, int] = (0, 1)) -> list[tuple[str | None, list[int]]]:
    """Request indices grouped by the replica their keys prefer (router `slot` = (rank, routers)), each group with a
    key that prefers it (its first member's). Replicas not known yet: one group per key (the request router places
    each call); no keys or one replica: one group."""
    if not keys:
        return []
    if replica_ids is None or len(replica_ids) == 1 or any(k is None for k in keys):
        return [(keys[0], list(range(len(keys))))]
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        where = preferred_order(key, list(replica_ids), *slot)[0] if replica_ids else key
        groups.setdefault(where, []).append(i)
    return [(keys[idx[0]], idx) for idx in groups.values()]


async def each_replica(handle: Any, call: Callable[[str | None], Awaitable[Any]]) -> list[Any]:
    """`call(key)` once per live replica of the handle's deployment, each key pinned to one (stats of every
    replica; a reply names its `replica`); one call without a key where the replica set is not known (a local
    stand-in), or first, before this process's request router has seen the replicas."""
    replicas = live_replicas(handle)
    if not replicas:  # this process's first call through the handle is what starts its request router
        first = await call(None)
        replicas = live_replicas(handle)
        rest = [r for r in replicas or () if r != (first or {}).get("replica")]
        return [first, *[await call(pinned("stats", r)) for r in rest]]
    # One after another: Serve's request router hands a free replica to the oldest pending call, so concurrent
    # calls pinned to different idle replicas can wait on each other until their timeout.
    return [await call(pinned("stats", r)) for r in replicas]


async def split_call(handle: Any, keys: list[str | None],
                     call: Callable[[list[int], str | None], Awaitable[Any]]) -> list[tuple[list[int], Any]]:
    """`call(indices, key)` once per replica the requests' keys prefer, concurrently: (indices, reply) per call."""
    replicas = live_replicas(handle)
    parts = split_by_replica(keys, replicas, router_slot() if replicas else (0, 1))
    replies = await asyncio.gather(*(call(idx, key) for key, idx in parts))
    return [(idx, reply) for (_, idx), reply in zip(parts, replies)]


class Affinity:
    """A router client's side of affinity for one deployment: the router's routing key (each sequence's key is it
    plus the sequence id, `key_for`, pinned on its first call where prefix routing places it), and per live sequence
    the tokens whose KV the deployment computed in the last successful round. `expected` is how many of a new call's
    leading tokens that covers (what the replica holds if nothing moved); `record` counts what a replica reported
    recomputing into `s2d_recomputed_tokens_total{deployment, replica}` (each call counted once, by its caller)."""

    def __init__(self, key: str | None, deployment: str, counter: Any = None,
                 routing: PrefixRoutingConfig | None = None, adapters: AdapterResidency | None = None) -> None:
        self.key, self.deployment, self.counter = key, deployment, counter
        self.routing = routing if routing is not None and routing.enabled else None
        # A LoRA target's adapter residency per replica (None: adapter rows placed like any other).
        self.adapters = adapters
        self.max_imbalance = (routing or PrefixRoutingConfig()).max_imbalance
        self.recomputed: dict[str, int] = {}  # replica -> tokens it recomputed for this client's calls
        self._tokens: dict[str, list[int]] = {}
        self._pins: dict[str, str | None] = {}  # live sequence -> the replica its first call chose (None: home rule)

    def key_for(self, seq_id: str, tokens: list[int] | None = None, committed: int = 0,
                replicas: tuple[str, ...] | None = None, adapter: str = "") -> str | None:
        """The key of a sequence's calls. Its first call (given its `tokens`, of which `committed` are its own, not
        draft tokens, and its LoRA `adapter`) decides once whether it is pinned, and where (`place`); later calls
        keep that, each recording its adapter as used on its replica."""
        key = sequence_key(self.key, seq_id)
        if key is None:
            return None
        if seq_id not in self._pins and tokens is not None:
            self._pins[seq_id] = self.place(tokens[:committed], replicas, adapter)
        pin = self._pins.get(seq_id)
        if pin is not None and adapter and self.adapters is not None:
            self.adapters.used(pin, adapter)
        return key if pin is None else pinned(key, pin)

    def place(self, prompt: list[int], replicas: tuple[str, ...] | None, adapter: str = "") -> str | None:
        """The replica a new sequence goes to: by adapter affinity for a LoRA row where it is on, else by prefix
        routing; None (the home rule) when neither applies, the replica set is not known or has one member, or
        (prefix routing) the prompt is shorter than a block."""
        if not replicas or len(replicas) < 2:
            return None
        prefix = prefix_key(prompt, self.routing.block_tokens) if self.routing is not None else None
        if adapter and self.adapters is not None:
            return place_adapter(adapter, prefix, list(replicas), self.loads(),
                                 self.adapters.holders(adapter, list(replicas)), self.max_imbalance)
        if prefix is None:
            return None
        return place_new(prefix, list(replicas), self.loads(), self.max_imbalance)

    def loads(self) -> dict[str, int]:
        """Live sequences of this client pinned to each replica."""
        return dict(Counter(p for p in self._pins.values() if p is not None))

    def gathered(self, parts: list[tuple[list[int], Any]], n: int) -> list:
        """The results of a round split over replicas (`split_call`), in request order; each call's recomputed
        tokens recorded against the replica that answered it."""
        out: list = [None] * n
        for idx, reply in parts:
            self.record(reply.recomputed, reply.replica)
            for i, result in zip(idx, reply.results):
                out[i] = result
        return out

    def expected(self, seq_id: str, tokens: list[int]) -> int:
        done = self._tokens.get(seq_id)
        return 0 if done is None else common_prefix(done, tokens)

    def computed(self, seq_id: str, tokens: list[int]) -> None:
        self._tokens[seq_id] = list(tokens)

    def forget(self, seq_id: str) -> None:
        self._tokens.pop(seq_id, None)
        self._pins.pop(seq_id, None)

    def record(self, recomputed: int, replica: str) -> None:
        self.recomputed[replica] = self.recomputed.get(replica, 0) + recomputed
        if self.counter is not None:
            self.counter.labels(self.deployment, replica).inc(recomputed)
