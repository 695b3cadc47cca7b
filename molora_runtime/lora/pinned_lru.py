"""Least-recently-used order with pins and holds: the eviction rule of the in-memory tiers.

The composition gate slots and the host tier of parsed adapters keep their entries in use
order and give up the least recently used one that nobody pinned and no running request
holds; each tier keeps its own payload (a slot index, a parsed adapter) and its own capacity
(a slot count, a byte budget). The adapter slots keep the same pins and holds but order their
victims by recent uses (`PinnedLFU`, molora_runtime/lora/pinned_lfu.py, a subclass).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class PinnedLRU(Generic[K, V]):
    """Key -> value in use order; pinned keys and keys with holds are never victims."""

    def __init__(self) -> None:
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._pins: set[K] = set()
        self._holds: Counter[K] = Counter()

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[K]:
        return list(self._entries)

    def items(self) -> list[tuple[K, V]]:
        return list(self._entries.items())

    def get(self, key: K) -> V | None:
        """The value of `key` (marking it most recently used), or None."""
        if key not in self._entries:
            return None
        self._entries.move_to_end(key)
        return self._entries[key]

    def peek(self, key: K) -> V | None:
        """The value of `key` without touching its place in the order."""
        return self._entries.get(key)

    def __getitem__(self, key: K) -> V:
        """The value of `key` without touching its place in the order; KeyError when absent."""
        return self._entries[key]

    def put(self, key: K, value: V) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)

    def pop(self, key: K) -> V:
        """Remove `key` (its holds go with it; a pin stays for when it comes back)."""
        self._holds.pop(key, None)
        return self._entries.pop(key)

    def pin(self, key: K) -> None:
        """Never evict `key`, now or once it is (or becomes) resident."""
        self._pins.add(key)

    def unpin(self, key: K) -> None:
        self._pins.discard(key)

    def pinned(self, key: K) -> bool:
        return key in self._pins

    def hold(self, key: K) -> None:
        """One more user of `key` (a running request); held keys are never evicted."""
        self._holds[key] += 1

    def unhold(self, key: K) -> None:
        if self._holds[key] > 0:
            self._holds[key] -= 1
        if self._holds[key] == 0:
            del self._holds[key]

    def held(self, key: K) -> bool:
        return self._holds[key] > 0

    def evictable(self, key: K) -> bool:
        return key not in self._pins and self._holds[key] == 0

    def victims(self, keep: Iterable[K] = ()) -> Iterator[K]:
        """Evictable keys outside `keep`, least recently used first."""
        keep = set(keep)
        return (k for k in list(self._entries) if k not in keep and self.evictable(k))
