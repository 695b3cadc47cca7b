"""Python's garbage collector in a serving process: freeze start-up's heap, meter every pause.

A model replica holds ~460K GC-tracked objects once its engine is up (torch, Ray, FastAPI,
pydantic, the tokenizer), a router ~270K. A full (generation-2) collection walks all of them
while holding the GIL: measured during the endpoint benchmark on the 2-core box, 285 ms in the
replica (no step runs: every stream stalls) and 217 ms in the router (no token moves). Python
runs one whenever what survived since the last is a quarter of what lives, here every few
minutes under load. `gc.freeze()` once start-up is done moves those objects to the permanent
generation, which collections skip; what serving allocates later is still collected.

`GcPauseMeter` times every collection (a `gc.callbacks` hook) so the pauses are on the
dashboard. The hook only appends to a deque: it runs inside whatever allocation triggered
the collection, possibly under a lock that recording a metric would take again, so a daemon
thread hands the pauses to the metric sink every few seconds instead.
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


def freeze_startup_heap(role: str) -> int:
    """Collect once, then move every surviving object out of future collections' reach.

    Call when a process has finished starting (weights, tokenizer, imports are in place);
    returns how many objects were frozen.
    """
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(
        "%s: froze %d start-up objects out of the garbage collector's reach (%.0f ms)",
        role,
        frozen,
        (time.perf_counter() - start) * 1000,
    )
    return frozen


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
