"""The serving processes' garbage-collector handling (deployments/heap.py), without Ray."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import pytest

from deployments.heap import GcPauseMeter, freeze_startup_heap


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Give the test process its collector back as it was."""
    yield
    gc.unfreeze()


class Cycle:
    """A reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_freeze_moves_startup_objects_out_of_reach_but_later_garbage_is_collected(
    unfrozen: None,
) -> None:
    startup = [Cycle() for _ in range(1000)]
    frozen = freeze_startup_heap("test")
    assert frozen == gc.get_freeze_count() >= 1000
    assert startup[0].me is startup[0]  # frozen objects stay alive and usable
    assert not any(isinstance(o, Cycle) for o in gc.get_objects())  # no collection walks them

    later = Cycle()
    ref = weakref.ref(later)
    del later
    gc.collect()
    assert ref() is None, "garbage made after the freeze is still collected"


def test_meter_hands_every_pause_to_the_sink_from_its_own_thread() -> None:
    seen: list[tuple[int, float, str]] = []
    meter = GcPauseMeter(
        lambda gen, s: seen.append((gen, s, threading.current_thread().name)), period_s=0.05
    ).start()
    try:
        gc.collect()  # a full collection
        gc.collect(0)
        done = threading.Event()
        for _ in range(100):  # the thread flushes within a few periods
            if {g for g, _, _ in seen} >= {0, 2}:
                done.set()
                break
            threading.Event().wait(0.05)
        assert done.is_set(), seen
    finally:
        meter.stop()
    assert all(s >= 0 for _, s, _ in seen)
    assert {name for _, _, name in seen} == {"gc-pause-meter"}
    assert meter._on_gc not in gc.callbacks  # stop() unhooks


def test_a_failing_sink_loses_the_pause_not_the_meter() -> None:
    calls: list[int] = []

    def flaky(generation: int, seconds: float) -> None:
        calls.append(generation)
        if len(calls) == 1:
            raise RuntimeError("metrics agent away")

    meter = GcPauseMeter(flaky, period_s=60)  # no periodic flush: flush by hand
    meter.start()
    try:
        gc.collect()
        gc.collect()
        assert meter.flush() >= 2
        assert len(calls) >= 2
        gc.collect()
        assert meter.flush() >= 1
    finally:
        meter.stop()


def test_stop_flushes_what_is_pending_and_is_idempotent() -> None:
    seen: list[int] = []
    meter = GcPauseMeter(lambda g, s: seen.append(g), period_s=60).start()
    gc.collect()
    meter.stop()
    assert 2 in seen
    meter.stop()
    count = len(seen)
    gc.collect()
    meter.flush()
    assert len(seen) == count  # unhooked: nothing new recorded
