"""Least-frequently-used order with aging, pins and holds: the eviction rule of the adapter slots.

Adapter traffic is skewed (a few adapters take most requests, a long tail is asked for now and
then) and a request of the tail must still take a slot to run. Under least recently used, each
such request evicts whichever adapter was idle longest, often a popular one that is back a
moment later, so the slots churn. Here every lookup counts a use of its key, found or not
(TinyLFU's frequency sample: the history covers adapters not resident too), and the victim is
the evictable key with the fewest recent uses, least recently used among equals: a tail adapter
loaded for one request is the next one out, and the popular ones stay. Counts are halved each
time `window` uses were counted (TinyLFU's reset), so adapters that were hot and went cold lose
their slots within a few windows, and the history stays within `window` keys.

Pins and holds are `PinnedLRU`'s: a pinned key or one a running request holds is never a
victim, whatever its count.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Iterator
from typing import TypeVar

from molora_runtime.lora.pinned_lru import PinnedLRU

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

WINDOW_PER_ENTRY = 10  # TinyLFU's sample size: ten uses per entry the cache holds


class PinnedLFU(PinnedLRU[K, V]):
    """Key -> value; victims are the evictable keys with the fewest recent uses, LRU among equals."""

    def __init__(self, window: int) -> None:
        """`window`: uses counted between two halvings of every count (at least 1)."""
        super().__init__()
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.window = window
        self._uses: Counter[K] = Counter()
        self._counted = 0

    def tracked(self) -> int:
        """Keys whose uses are counted now, resident or not (at most `window`)."""
        return len(self._uses)

    def uses(self, key: K) -> int:
        """Recent uses of `key` (resident or not), as eviction weighs them."""
        return self._uses[key]

    def get(self, key: K) -> V | None:
        """The value of `key` (marking it most recently used), or None; either way one use."""
        self._count(key)
        return super().get(key)

    def _count(self, key: K) -> None:
        self._uses[key] += 1
        self._counted += 1
        if self._counted >= self.window:
            self._age()

    def _age(self) -> None:
        """Halve every count, forgetting keys that reach zero (TinyLFU's reset)."""
        aged: Counter[K] = Counter()
        for key, n in self._uses.items():
            if n // 2:
                aged[key] = n // 2
        self._uses = aged
        self._counted = sum(aged.values())

    def victims(self, keep: Iterable[K] = ()) -> Iterator[K]:
        """Evictable keys outside `keep`, fewest recent uses first, least recently used among
        equals."""
        keep = set(keep)
        order = [
            (self._uses[k], i, k)
            for i, k in enumerate(self._entries)
            if k not in keep and self.evictable(k)
        ]
        return (k for *_, k in sorted(order, key=lambda t: (t[0], t[1])))


def slot_order(num_slots: int) -> PinnedLFU[str, int]:
    """The adapter slots' eviction order for a hot-set of `num_slots` (name -> slot), as the
    hot-set keeps it and the placement simulator drives it."""
    return PinnedLFU(window=WINDOW_PER_ENTRY * max(1, num_slots))
