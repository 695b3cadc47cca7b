"""Histogram observations held in plain Python, recorded into Ray's histograms in bulk.

A Ray histogram's `observe` merges and checks its tags in Python before the native record, a
few microseconds a call; the router's inter-token latency pays that per token. Here a process
keeps each (histogram, labels) group's values in a list and records the group at once: the
labels are merged and checked once per group (through the public `observe`, on its first
value), the rest go straight to the native record with those same labels. Every value is still
recorded, so a histogram's buckets, sum and count mean what they meant.

`Recorder.flush` runs at most every `FLUSH_S` while items stream and whenever a request ends,
so a scrape never waits on values an idle router holds. One event loop uses it (no lock).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

logger = logging.getLogger("ray.serve")

FLUSH_S = 0.05
Labels = tuple[tuple[str, str], ...]


def _record(hist: Any, labels: dict[str, str], values: list[float]) -> None:
    """Record every value of one group: the first through `observe` (it merges and checks the
    labels), the rest through the native histogram with the labels it would have merged."""
    hist.observe(values[0], tags=dict(labels))
    native = getattr(hist, "_metric", None)
    defaults = getattr(hist, "_default_tags", None)
    if native is None or not isinstance(defaults, dict):
        for value in values[1:]:
            hist.observe(value, tags=dict(labels))
        return
    final = {**defaults, **labels}
    record = native.record
    for value in values[1:]:
        record(value, tags=final)


class Recorder:
    """One process's pending histogram values, by (histogram, labels)."""

    def __init__(self, flush_s: float = FLUSH_S) -> None:
        self.flush_s = flush_s
        self._pending: dict[tuple[int, Labels], list[float]] = {}
        self._hists: dict[int, Any] = {}
        self._last = time.perf_counter()

    def add(self, hist: Any, labels: Labels, value: float, count: int = 1) -> None:
        """Hold `count` observations of `value` for `hist` under `labels`."""
        key = (id(hist), labels)
        values = self._pending.get(key)
        if values is None:
            values = self._pending[key] = []
            self._hists[id(hist)] = hist
        if count == 1:
            values.append(value)
        else:
            values.extend([value] * count)

    def pending(self) -> int:
        """Values held and not yet recorded."""
        return sum(len(v) for v in self._pending.values())

    def maybe_flush(self, now: float) -> None:
        """Flush if `FLUSH_S` passed since the last flush (`now`: a `perf_counter` reading)."""
        if now - self._last >= self.flush_s:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        """Record everything held; a histogram that fails loses its group, never the caller."""
        self._last = time.perf_counter() if now is None else now
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        for (hist_id, labels), values in pending.items():
            with contextlib.suppress(Exception):
                _record(self._hists[hist_id], dict(labels), values)


RECORDER = Recorder()
