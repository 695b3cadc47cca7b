"""The serving processes' garbage-collector handling (deployments/replica/heap.py)."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

from deployments.replica.heap import GcPauseMeter

REPO = Path(__file__).resolve().parents[3]


def test_serve_freezes_the_startup_heap_and_no_shipped_config_turns_that_off() -> None:
    """Ray Serve's freeze after the constructor is what keeps full collections short
    (deployments/replica/heap.py); a shipped config must not switch it off."""
    from ray.serve._private import constants

    assert constants.RAY_SERVE_FREEZE_GC_ON_STARTUP
    shipped = [REPO / "serve_config.yaml", *sorted((REPO / "k8s").rglob("*.yaml"))]
    for path in shipped:
        assert "RAY_SERVE_FREEZE_GC_ON_STARTUP" not in path.read_text(), path


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
