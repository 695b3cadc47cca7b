"""Each adapter's share of recent requests, as the router sees them (pure, no Ray; a clock passed in).

Placement keeps a request on a replica that holds its adapter until that replica is more than a
bound above the others, then spills it (deployments/placement/affinity.py). For an adapter that
takes a large share of the traffic the spill is right: its demand needs more than one replica,
and the copy it loads elsewhere serves many requests. For a cold adapter it is not: the copy
serves one request, costs a load (often a store fetch) and evicts another adapter, and moving one
cold request shifts little load. Counting each adapter's requests with an exponential decay of
half-life `half_life_s` tells the two apart, over a few minutes of traffic, without a window of
timestamps. Counts below `floor` of a request are dropped, so the table holds only adapters
asked for recently.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

RESCALE_AT = 2.0**10  # weights are brought back to 1 (and small counts dropped) past this


class DemandTracker:
    """Decayed request counts per adapter name and in total.

    A request at time t adds 2^((t - origin) / half_life) instead of decaying every count
    at every request: ratios of counts are what decay leaves unchanged, so shares read
    straight off them, and each request costs O(1). Past `RESCALE_AT` the weights are
    divided down, and counts under `floor` of a request dropped."""

    def __init__(self, half_life_s: float = 60.0, floor: float = 0.05) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        self.half_life_s = half_life_s
        self.floor = floor
        self._counts: dict[str, float] = {}
        self._total = 0.0
        self._origin: float | None = None

    def __len__(self) -> int:
        return len(self._counts)

    def _weight(self, now: float) -> float:
        if self._origin is None:
            self._origin = now
        weight = math.exp2(max(0.0, now - self._origin) / self.half_life_s)
        if weight > RESCALE_AT:
            self._counts = {
                n: c / weight for n, c in self._counts.items() if c / weight >= self.floor
            }
            self._total /= weight
            self._origin, weight = now, 1.0
        return weight

    def observe(self, names: Iterable[str], now: float) -> None:
        """One request for the adapters `names` (an empty set: a base-model request)."""
        weight = self._weight(now)
        self._total += weight
        for name in set(names):
            self._counts[name] = self._counts.get(name, 0.0) + weight

    def share(self, name: str) -> float:
        """The fraction of recent requests that named `name` (0 before any request)."""
        return self._counts.get(name, 0.0) / self._total if self._total > 0 else 0.0
