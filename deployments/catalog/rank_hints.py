"""Adapter ranks as the store's catalog states them, for placement by rank pool.

The router deployment loads the catalog (deployments/catalog/store.py) in the same process
that runs its model handle's request router; the catalog publishes each adapter's manifest
rank here and the request router reads it, so even an adapter no replica has loaded yet is
placed where its rank fits. Replicas' own reports (the largest rank of any module, once the
weights were read) take precedence over these.
"""

from __future__ import annotations

from collections.abc import Mapping

_ranks: dict[str, int] = {}


def publish(ranks: Mapping[str, int]) -> None:
    """Replace the known ranks with a new catalog's (name without version -> rank)."""
    global _ranks
    _ranks = {str(n): int(r) for n, r in ranks.items() if int(r) > 0}


def update(ranks: Mapping[str, int | None]) -> None:
    """Change only these names' ranks (a change re-read them alone); None drops a name."""
    global _ranks
    merged = dict(_ranks)  # a new dict: the request router may be reading the old one
    for n, r in ranks.items():
        if r is not None and int(r) > 0:
            merged[str(n)] = int(r)
        else:
            merged.pop(str(n), None)
    _ranks = merged


def catalog_rank(name: str) -> int | None:
    return _ranks.get(name)
