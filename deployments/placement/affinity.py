"""Adapter-affinity placement as pure functions (no Ray), so the policy is unit-testable.

A request goes to the replica whose hot-set already holds the most of its adapters, among the
replicas whose load is within a bound of the others' average load (consistent hashing with
bounded loads: a replica more than the bound above the rest takes no more until they catch up);
among those equal on slots, to the one whose host tier holds the most of the rest parsed (a slot
copy away, no fetch): a slot hit beats a host hit beats a miss. Ties, and adapter sets that no
replica holds yet, are broken by rendezvous (highest-random-weight) hashing of the adapter set
over replica ids: every adapter set has a stable home, different sets spread over replicas, and
hot-sets shard instead of every replica loading everything. When the home is overloaded the
set spills to the next replica in its rendezvous order, which then warms up as a second home.
Where the router counts each set's share of recent requests (deployments/placement/demand.py),
a cold set (well under one replica's part of the traffic) stays with its holder up to twice the
bound: its spill would cost a load and an eviction to move one request, while a hot set's
requests, spread by load over the replicas holding it, balance the load without loads.

With rank pools (`hot_set.rank_pools`) and the adapters' ranks known, the pools decide room
(deployments/placement/rank_fit.py): a replica that could not hold the adapters at all is never
first while another could, and among equals on slots and host tier, a free slot beats an
eviction beats a wait, then the smallest pools taken. Without pools or ranks, room is slots.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from deployments.placement.rank_fit import EVICT, FREE, Fit, PoolView, fit

Outcome = Literal["affinity", "host", "spill", "new", "base"]
COLD_SHARE = 0.5  # a set under half of one replica's part of the traffic is cold
COLD_BOUND_FACTOR = 2.0  # a cold set's holder keeps it up to twice the load bound


def adapter_key(adapters: Iterable[str]) -> str:
    """Canonical key of an adapter set (order and duplicates do not matter)."""
    return "+".join(sorted(set(adapters)))


def base_name(ref: str) -> str:
    return ref.split("@", 1)[0]


def rendezvous_score(key: str, replica_id: str) -> int:
    """Stable 64-bit weight of (key, replica); blake2b so it is identical across processes."""
    digest = hashlib.blake2b(f"{key}\x00{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, replica_ids: Iterable[str]) -> list[str]:
    """Replica ids from most to least preferred home of `key`."""
    return sorted(replica_ids, key=lambda rid: rendezvous_score(key, rid), reverse=True)


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one replica: its hot-set and its load (in-flight requests)."""

    replica_id: str
    hot_set: frozenset[str] = field(default_factory=frozenset)
    load: int = 0
    capacity: int | None = None  # max ongoing requests; None = unbounded
    slots: int | None = None  # hot-set slots; None = unknown (assume room)
    host_set: frozenset[str] = field(default_factory=frozenset)  # parsed in host memory
    pools: tuple[PoolView, ...] = ()  # rank pools, smallest rank first; () = padded or unknown

    def overlap(self, adapters: frozenset[str]) -> int:
        held = {base_name(a) for a in self.hot_set}
        return sum(1 for a in adapters if base_name(a) in held)

    def host_overlap(self, adapters: frozenset[str]) -> int:
        """Adapters not in a slot but parsed in host memory (loads without a fetch)."""
        slots = {base_name(a) for a in self.hot_set}
        host = {base_name(a) for a in self.host_set}
        return sum(1 for a in adapters if base_name(a) in host and base_name(a) not in slots)

    def has_room(self, adapters: frozenset[str]) -> bool:
        """Can the missing adapters be loaded without evicting (so no other set loses its home)?"""
        if self.slots is None:
            return True
        return self.slots - len(self.hot_set) >= len(adapters) - self.overlap(adapters)

    def rank_fit(self, adapters: frozenset[str], ranks: Mapping[str, int]) -> Fit:
        """How its rank pools take the adapters it lacks, of known rank; without pools or
        known ranks, free when it has room (as if every slot fitted), else an eviction."""
        held, names = {base_name(a) for a in self.hot_set}, {base_name(a) for a in adapters}
        missing = [ranks[n] for n in names - held if n in ranks]
        if not self.pools or not missing:
            return Fit(cost=FREE if self.has_room(adapters) else EVICT)
        return fit(self.pools, missing, [ranks[n] for n in names & held if n in ranks])

    def full(self) -> bool:
        return self.capacity is not None and self.load >= self.capacity


@dataclass(frozen=True)
class Placement:
    """Replicas in preference order (first = chosen) and why the first was chosen."""

    ranked: list[str]
    outcome: Outcome


def load_limit(reference: float, bound: int, ratio: float) -> float:
    """Highest load still eligible: a reference load plus max(bound, ratio x reference)."""
    return reference + max(bound, ratio * reference)


def load_limits(replicas: Sequence[ReplicaView], bound: int, ratio: float) -> dict[str, float]:
    """Each replica's highest eligible load: the bound over the average load of the other open
    (not full) replicas. Against the average rather than the least loaded one, because one
    replica that just drained (or just started) would otherwise push every other replica past
    the bound, and every set held there would spill (a load each, and a copy that evicts some
    other set) while the replicas holding them had room; with two replicas the other's load is
    the reference, as it always was."""
    open_ids = {r.replica_id for r in replicas if not r.full()} or {r.replica_id for r in replicas}
    total = sum(r.load for r in replicas if r.replica_id in open_ids)
    limits = {}
    for r in replicas:
        own = r.replica_id in open_ids
        others = len(open_ids) - own
        mean = (total - (r.load if own else 0)) / others if others else r.load
        limits[r.replica_id] = load_limit(mean, bound, ratio)
    return limits


def place(
    adapters: Iterable[str],
    replicas: Sequence[ReplicaView],
    load_bound: int = 4,
    load_bound_ratio: float = 0.25,
    ranks: Mapping[str, int] | None = None,
    share: float | None = None,
    cold_share: float = COLD_SHARE,
    cold_bound_factor: float = COLD_BOUND_FACTOR,
) -> Placement:
    """Rank replicas for a request needing `adapters` (empty = base model); `ranks` gives
    the adapters' ranks where known (by name without version). `share`, where known, is the
    set's fraction of recent requests (deployments/placement/demand.py): a set under
    `cold_share` of one replica's part of the traffic (share x replicas) is cold, and a
    replica that holds it (slot or host tier) stays eligible up to `cold_bound_factor`
    times the load bound: spilling a cold set loads a copy and evicts another set to move
    one request's load, which the hot sets, spread by load over their holders, move
    cheaper."""
    if not replicas:
        return Placement(ranked=[], outcome="new")
    wanted = frozenset(adapters)
    key = adapter_key(wanted)
    hrw = {rid: i for i, rid in enumerate(rendezvous_order(key, [r.replica_id for r in replicas]))}
    limits = load_limits(replicas, load_bound, load_bound_ratio)
    cold = share is not None and share * len(replicas) < cold_share
    cold_limits = (
        load_limits(
            replicas, round(load_bound * cold_bound_factor), load_bound_ratio * cold_bound_factor
        )
        if cold
        else limits
    )

    def eligible(r: ReplicaView) -> bool:
        if cold and (r.overlap(wanted) > 0 or r.host_overlap(wanted) > 0):
            return not r.full() and r.load <= cold_limits[r.replica_id]
        return not r.full() and r.load <= limits[r.replica_id]

    if not wanted:
        # Base-model requests have no affinity: least loaded first, rendezvous breaks ties.
        ranked = sorted(replicas, key=lambda r: (r.full(), r.load, hrw[r.replica_id]))
        return Placement(ranked=[r.replica_id for r in ranked], outcome="base")

    fits = {r.replica_id: r.rank_fit(wanted, ranks or {}) for r in replicas}

    def rank_key(r: ReplicaView) -> tuple[bool, bool, int, int, int, int, bool, int, int]:
        # Able to hold the set at all first (rank pools); then eligible; then most adapters
        # already in slots; then most of the rest parsed in host memory; then how the rank
        # pools take the rest (free slot, eviction, wait; smallest pools); then room to load
        # the rest without evicting another set's adapters; then, among replicas that
        # already hold the set equally well, the least
        # loaded (a hot adapter resident on several replicas is shared by load, not piled on
        # its home up to the bound); then the set's rendezvous order (a set held nowhere goes
        # to one stable home, so concurrent first requests load it once).
        holds = r.overlap(wanted) > 0 or r.host_overlap(wanted) > 0
        pools = fits[r.replica_id]
        return (
            pools.cannot,
            not eligible(r),
            -r.overlap(wanted),
            -r.host_overlap(wanted),
            pools.cost,
            pools.taken,
            not r.has_room(wanted),
            r.load if holds else 0,
            hrw[r.replica_id],
        )

    ranked = sorted(replicas, key=rank_key)
    best_overlap = max(r.overlap(wanted) for r in replicas)
    best_host = max(r.host_overlap(wanted) for r in replicas)
    chosen = ranked[0]
    if best_overlap == 0 and best_host == 0:
        outcome: Outcome = "new" if hrw[chosen.replica_id] == 0 else "spill"
    elif best_overlap > 0 and chosen.overlap(wanted) == best_overlap:
        outcome = "affinity"
    elif best_overlap == 0 and chosen.host_overlap(wanted) == best_host:
        outcome = "host"
    else:
        outcome = "spill"
    return Placement(ranked=[r.replica_id for r in ranked], outcome=outcome)
