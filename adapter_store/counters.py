"""The cumulative counters every adapter tier keeps (device slots, host memory, local disk), so
the tier report and the metrics read the same four fields from each."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TierCounters:
    """Look-ups that found the adapter (`hits`) or not (`misses`), adapters brought into the tier
    (`loads`) and pushed out of it (`evictions`), since the tier was made."""

    hits: int = 0
    misses: int = 0
    loads: int = 0
    evictions: int = 0
