"""Whether a replica's rank pools can take a request's missing adapters, and at what cost.

Pure functions (no Ray). A replica with rank pools reports, per pool, its rank, slots, free
slots and evictable slots (resident, not pinned, held by no running request). For the adapters
of known rank that a request would still have to load there, `fit` follows the hot-set's own
rule (molora_runtime/lora/rank_placement.py): largest rank first, a free slot of the smallest
pool that fits, else an eviction in the smallest fitting pool with a victim, else a wait.
Placement ranks replicas by that: able to hold them at all, then free < evict < wait, then the
smaller the slots taken (the sum of their pools' ranks), so a rank-4 adapter does not take the
last rank-64 slot while another replica has a free rank-8 one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

FREE, EVICT, WAIT = 0, 1, 2
MAX_POOLS = 16  # as many as `hot_set.rank_pools` may list


@dataclass(frozen=True)
class PoolView:
    """One rank pool of a replica, as it reported it."""

    rank: int
    slots: int
    free: int = 0
    evictable: int = 0


@dataclass(frozen=True)
class Fit:
    """How a replica's pools take a request's missing adapters (smaller sorts first)."""

    cannot: bool = False  # a rank above every pool, or more than the pools hold together
    cost: int = FREE  # FREE, EVICT or WAIT: the worst any of the adapters needs
    taken: int = 0  # sum of the ranks of the pools whose slots they would take


def parse_pools(reported: Any) -> tuple[PoolView, ...]:
    """A replica's `rank_pools` report ([rank, slots, free, evictable] rows); anything
    malformed reads as no pools, so a bad report never breaks routing."""
    if not isinstance(reported, list | tuple) or len(reported) > MAX_POOLS:
        return ()
    pools = []
    for row in reported:
        if (
            not isinstance(row, list | tuple)
            or len(row) != 4
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in row)
        ):
            return ()
        rank, slots, free, evictable = row
        if rank < 1 or slots < 1 or not 0 <= free <= slots or not 0 <= evictable <= slots:
            return ()
        pools.append(PoolView(rank, slots, free, min(evictable, slots - free)))
    return tuple(sorted(pools, key=lambda p: p.rank))


def fits_ever(pools: Sequence[PoolView], ranks: Iterable[int]) -> bool:
    """Whether adapters of `ranks` could sit in the pools together (pools nest by rank)."""
    ordered = sorted(pools, key=lambda p: p.rank)
    ranks = list(ranks)
    if not ordered:
        return not ranks
    for k in range(len(ordered)):
        below = ordered[k - 1].rank if k else 0
        if sum(1 for r in ranks if r > below) > sum(p.slots for p in ordered[k:]):
            return False
    return all(r <= ordered[-1].rank for r in ranks)


def fit(pools: Sequence[PoolView], ranks: Iterable[int], resident: Iterable[int] = ()) -> Fit:
    """Where adapters of `ranks` would land among `pools`, in the hot-set's order, beside the
    request's adapters of `resident` ranks already there (they keep their slots)."""
    ordered = sorted(pools, key=lambda p: p.rank)
    ranks = sorted(ranks, reverse=True)
    if not ordered or not ranks:
        return Fit()
    if not fits_ever(ordered, [*ranks, *resident]):
        return Fit(cannot=True, cost=WAIT)
    free = [p.free for p in ordered]
    evictable = [p.evictable for p in ordered]
    cost = taken = 0
    for rank in ranks:
        fitting = [i for i, p in enumerate(ordered) if p.rank >= rank]
        i = next((i for i in fitting if free[i] > 0), None)
        if i is not None:
            free[i] -= 1
        elif (i := next((i for i in fitting if evictable[i] > 0), None)) is not None:
            evictable[i] -= 1
            cost = max(cost, EVICT)
        else:
            i = fitting[0]
            cost = WAIT
        taken += ordered[i].rank
    return Fit(cost=cost, taken=taken)


def occupy(pools: tuple[PoolView, ...], rank: int) -> tuple[PoolView, ...]:
    """`pools` after an adapter of `rank` took a slot (placed here, not yet reported)."""
    fitting = [p for p in pools if p.rank >= rank]
    target = next((p for p in fitting if p.free > 0), None)
    if target is None:
        target = next((p for p in fitting if p.evictable > 0), None)
        if target is None:
            return pools
        taken = PoolView(target.rank, target.slots, target.free, target.evictable - 1)
    else:
        taken = PoolView(target.rank, target.slots, target.free - 1, target.evictable)
    return tuple(taken if p is target else p for p in pools)
