"""Names a request asked for that the router's catalog lacks, read from the store alone.

A name published behind the router's back (written straight into the bucket or folder rather
than through the admin API, whose epoch bump reaches every router) is found by the first
request that names it, at the price of that name's own listing whatever the store holds,
instead of a full catalog reload. The reads are bounded so that callers naming random names
cannot turn the router into a store scanner: a name found absent is not read again for
`absent_ttl_s`, and reads take at most `share` of the wall time (a bucket of their measured
duration, `burst_s` deep).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

from deployments.catalog.model_names import (
    AdapterEntry,
    Catalog,
    CatalogCache,
    CompositionEntry,
    NameKey,
)

logger = logging.getLogger("ray.serve")

MAX_ABSENT = 4096  # names remembered as absent (the oldest are forgotten first)
# How long an absent name is not read again: short, since a client may ask for a name just
# before it is published; the read budget bounds what many distinct names cost.
ABSENT_TTL_S = 1.0
Entries = Mapping[NameKey, AdapterEntry | CompositionEntry | None]


class NameLookup:
    """Reads a request's unknown names from the store and installs those that exist."""

    def __init__(
        self,
        catalog: CatalogCache,
        read: Callable[[list[NameKey]], Entries],
        absent_ttl_s: float,
        share: float = 0.1,
        burst_s: float = 1.0,
    ) -> None:
        self.catalog = catalog
        self._read = read
        self._absent_ttl = absent_ttl_s
        self._share = share
        self._burst = burst_s
        self._tokens = burst_s
        self._filled_at = time.monotonic()
        self._absent: OrderedDict[NameKey, float] = OrderedDict()
        self._lock = asyncio.Lock()
        self.reads = 0  # store reads made (each one listing per name)

    async def find(self, keys: list[NameKey], seen: Catalog) -> bool:
        """Whether the catalog now differs from `seen` (the one the request failed on), after
        reading those of `keys` not known to be absent, if the read budget allows."""
        async with self._lock:
            if await self.catalog.get() is not seen:
                return True  # another request's read (or a reload) came in while this waited
            now = time.monotonic()
            wanted = [k for k in dict.fromkeys(keys) if not self._known_absent(k, now)]
            if not wanted or not self._budget(now):
                return False
            try:
                entries = await asyncio.to_thread(self._read, wanted)
            except Exception:
                logger.warning("reading %s from the store failed", wanted, exc_info=True)
                return False
            finally:
                self.reads += 1
                self._tokens -= time.monotonic() - now
            for key, entry in entries.items():
                if entry is None:
                    self._absent[key] = now
                    self._absent.move_to_end(key)
            while len(self._absent) > MAX_ABSENT:
                self._absent.popitem(last=False)
            return await self._install(now, entries)

    def _known_absent(self, key: NameKey, now: float) -> bool:
        at = self._absent.get(key)
        return at is not None and now - at < self._absent_ttl

    def _budget(self, now: float) -> bool:
        self._tokens = min(self._burst, self._tokens + (now - self._filled_at) * self._share)
        self._filled_at = now
        return self._tokens > 0

    async def _install(self, started: float, entries: Entries) -> bool:
        """Install the entries that differ from the catalog's (an unchanged catalog stays the
        same object, so callers' resolvers are not rebuilt for nothing)."""
        current = await self.catalog.get()
        changed = {
            key: entry
            for key, entry in entries.items()
            if (current.adapters if key[0] == "adapter" else current.compositions).get(key[1])
            != entry
        }
        if not changed:
            return False
        await self.catalog.apply(started, changed)
        return True
