"""Python's garbage collector in a serving process: time every pause, for the dashboard.

A full (generation-2) collection walks every object the collector tracks while holding the
GIL: in a model replica no decode step runs meanwhile, in a router no token moves. A replica
tracks hundreds of thousands of objects once its engine is up (torch, Ray, FastAPI, pydantic, the
tokenizer), so one full collection over them takes a noticeable pause. Ray Serve
(2.60) collects and `gc.freeze()`s a replica's heap once its constructor has returned
(`RAY_SERVE_FREEZE_GC_ON_STARTUP`, on by default; leave it on), which puts those objects out of
later collections' reach. What serving allocates
afterwards is still collected. `GcPauseMeter` reports those pauses, and Serve's start-up
collection once per process (the meter starts in the constructor, before it).

The meter hooks `gc.callbacks`. The hook only appends to a deque: it runs inside whatever
allocation triggered the collection, possibly under a lock that recording a metric would take
again, so a daemon thread hands the pauses to the metric sink every few seconds instead.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("ray.serve")

FLUSH_PERIOD_S = 5.0
MAX_PENDING = 10_000  # pauses kept between flushes (the oldest are dropped beyond that)

PauseSink = Callable[[int, float], None]  # (generation, seconds)


class GcPauseMeter:
    """Times each garbage collection of this process and hands `(generation, seconds)` to a
    sink from a daemon thread (never from inside the collection)."""

    def __init__(self, sink: PauseSink, period_s: float = FLUSH_PERIOD_S) -> None:
        self._sink = sink
        self._period_s = period_s
        self._pending: deque[tuple[int, float]] = deque(maxlen=MAX_PENDING)
        self._started_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started_at = time.perf_counter()
        elif self._started_at is not None:
            self._pending.append((info["generation"], time.perf_counter() - self._started_at))
            self._started_at = None

    def start(self) -> GcPauseMeter:
        gc.callbacks.append(self._on_gc)
        self._thread = threading.Thread(target=self._run, name="gc-pause-meter", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Unhook and hand over what is pending (idempotent)."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._period_s + 1)
        self.flush()

    def flush(self) -> int:
        """Hand every pending pause to the sink; returns how many."""
        handed = 0
        while self._pending:
            generation, seconds = self._pending.popleft()
            try:
                self._sink(generation, seconds)
            except Exception:  # a metrics hiccup must not end the meter
                logger.debug("recording a GC pause failed", exc_info=True)
            handed += 1
        return handed

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            self.flush()
