"""`PinnedLFU`, the hot-set slots' eviction order: fewest recent uses first, least recently used
among equals, counts halved every `window` uses; pinned and held keys are never victims, and on
a skewed stream it keeps the popular keys where least recently used lets the tail churn them."""

from __future__ import annotations

import random

import pytest

from molora_runtime.lora.pinned_lfu import WINDOW_PER_ENTRY, PinnedLFU, slot_order
from molora_runtime.lora.pinned_lru import PinnedLRU


def filled(window: int, uses: dict[str, int]) -> PinnedLFU[str, int]:
    order: PinnedLFU[str, int] = PinnedLFU(window)
    for i, (key, n) in enumerate(uses.items()):
        order.put(key, i)
        for _ in range(n):
            order.get(key)
    return order


def test_victims_fewest_uses_first_then_least_recent() -> None:
    order = filled(1000, {"a": 3, "b": 1, "c": 1, "d": 2})
    assert list(order.victims()) == ["b", "c", "d", "a"]
    order.get("b")  # b: two uses, now more recent than d
    assert list(order.victims()) == ["c", "d", "b", "a"]
    assert list(order.victims(keep=["c"])) == ["d", "b", "a"]


def test_pinned_and_held_keys_are_never_victims_whatever_their_count() -> None:
    order = filled(1000, {"rare": 0, "held": 0, "hot": 9})
    order.pin("rare")
    order.hold("held")
    assert list(order.victims()) == ["hot"]
    order.unhold("held")
    order.unpin("rare")
    assert list(order.victims()) == ["rare", "held", "hot"]


def test_a_lookup_counts_a_use_found_or_not_and_the_count_outlives_eviction() -> None:
    order = filled(1000, {"a": 1})
    assert order.get("b") is None  # a miss is a use of b, as TinyLFU counts it
    order.put("b", 1)
    assert order.uses("b") == 1
    order.pop("b")
    order.get("b")
    order.put("b", 2)
    assert order.uses("b") == 2 and list(order.victims()) == ["a", "b"]


def test_counts_halve_every_window_and_cold_keys_are_forgotten() -> None:
    order: PinnedLFU[str, int] = PinnedLFU(window=8)
    order.put("old", 0)
    for _ in range(6):
        order.get("old")
    order.get("once")
    assert order.uses("old") == 6 and order.uses("once") == 1
    order.get("new")  # the eighth use: every count halves, `once` drops to zero
    assert order.uses("old") == 3 and order.uses("once") == 0 and order.uses("new") == 0
    for _ in range(40):
        order.get("new")
    assert order.uses("old") == 0  # a key that went cold loses its weight within a few windows
    assert order.tracked() <= order.window  # the history stays bounded


def test_window_must_be_positive_and_slot_order_scales_with_the_slots() -> None:
    with pytest.raises(ValueError):
        PinnedLFU(0)
    assert slot_order(16).window == 16 * WINDOW_PER_ENTRY


def misses(order: PinnedLRU[str, int], stream: list[str], slots: int) -> int:
    """Demand paging as the hot-set does it: look up, else evict the first victim and load."""
    missed = 0
    for key in stream:
        if order.get(key) is not None:
            continue
        missed += 1
        if len(order) >= slots:
            order.pop(next(order.victims(keep=[key])))
        order.put(key, 0)
    return missed


def test_on_a_zipf_stream_it_misses_less_than_least_recently_used() -> None:
    rng = random.Random(0)
    keys = [f"a{i}" for i in range(200)]
    weights = [1 / (i + 1) ** 1.1 for i in range(200)]
    stream = rng.choices(keys, weights, k=20_000)
    lfu = misses(slot_order(16), stream, 16)
    lru = misses(PinnedLRU(), stream, 16)
    assert lfu < 0.9 * lru
