"""Which rank pool an adapter's slot comes from, and whether a set of adapters fits at once.

An adapter of rank r fits every pool of rank >= r. It takes a free slot of the smallest pool
that fits it, then a free slot of a larger one, and only then evicts (the hot-set's eviction
order) in the smallest pool with a victim: a free slot is never left empty while another
adapter is evicted. Pools nest by rank, so "fits at once" is Hall's condition over rank
thresholds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from molora_runtime.lora.peft_adapter import AdapterWeights
from molora_runtime.model.rank_pools import SlotPool


def adapter_rank(weights: AdapterWeights) -> int:
    """The largest rank of any of the adapter's modules (a `rank_pattern` may raise one)."""
    ranks = [a.shape[0] for layers in weights.modules.values() for a, _ in layers.values()]
    return max(ranks, default=weights.rank)


def fitting(pools: Iterable[SlotPool], rank: int) -> list[SlotPool]:
    """Pools that can hold an adapter of `rank`, smallest rank first."""
    return sorted((p for p in pools if p.rank >= rank), key=lambda p: p.rank)


def fits_at_once(pools: list[SlotPool], ranks: list[int], room: dict[SlotPool, int]) -> bool:
    """Whether adapters of `ranks` can all take a slot, `room[p]` slots being usable in `p`."""
    ordered = sorted(pools, key=lambda p: p.rank)
    for k in range(len(ordered)):
        below = ordered[k - 1].rank if k else 0
        need = sum(1 for r in ranks if r > below)
        if need > sum(room.get(p, 0) for p in ordered[k:]):
            return False
    return not any(r > ordered[-1].rank for r in ranks)


def pool_occupancy(
    pools: Iterable[SlotPool], names: Sequence[str | None], evictable: Callable[[str], bool]
) -> list[tuple[int, int, int, int]]:
    """Per pool (rank, slots, free, evictable), `names[slot]` being the adapter in each slot:
    what the cluster's placement needs to know of a replica's pools."""
    rows = []
    for pool in pools:
        held = [names[s] for s in range(pool.first, pool.first + pool.slots)]
        free = sum(1 for n in held if n is None)
        rows.append((pool.rank, pool.slots, free, sum(1 for n in held if n and evictable(n))))
    return rows
