"""Per-tier counters and per-stage load latencies of the adapter tiers (slots, host, disk).

An adapter reaches a slot through three tiers — the store's disk cache, parsed weights in host
memory, a hot-set slot — and each can hit, miss, load and evict. Counting them per tier (never
per adapter) keeps the exported metrics bounded however many adapters are served, while the
per-adapter residency view (`residency`) is an on-demand snapshot, not a metric label.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel

Tier = Literal["slot", "host", "disk"]
Stage = Literal["fetch", "parse", "copy"]
TIERS: tuple[Tier, ...] = ("slot", "host", "disk")
STAGES: tuple[Stage, ...] = ("fetch", "parse", "copy")
# Where an adapter is, best first: in a slot, parsed in host memory, being fetched/parsed,
# verified on local disk, or only in the store.
Residency = Literal["slot", "host", "loading", "disk", "store"]
STAGE_BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PENDING_CAP = 10_000  # observations kept for the exporter if it stops draining


class TierCounts(BaseModel):
    """One tier's counters as reported (cumulative since start; bytes is current)."""

    hits: int = 0
    misses: int = 0
    loads: int = 0
    evictions: int = 0
    bytes: int = 0
    capacity_bytes: int | None = None
    capacity_slots: int | None = None
    entries: int = 0


class StageLatency(BaseModel):
    """A load stage's latency histogram (cumulative bucket counts, Prometheus style)."""

    buckets: list[float]
    counts: list[int]  # observations <= buckets[i]; the last entry is +Inf (= count)
    count: int = 0
    sum_s: float = 0.0


class TierReport(BaseModel):
    tiers: dict[str, TierCounts]
    stages: dict[str, StageLatency]


class ResidencyReport(TierReport):
    """What the replica stats endpoint answers: the tiers plus each adapter's residency."""

    residency: dict[str, str]
    counts: dict[str, int]


@dataclass
class _Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(STAGE_BUCKETS) + 1))
    count: int = 0
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        for i, bound in enumerate(STAGE_BUCKETS):
            if seconds <= bound:
                self.counts[i] += 1
        self.counts[-1] += 1
        self.count += 1
        self.total += seconds


class StageTimes:
    """Load-stage latencies: a bounded histogram per stage, plus pending observations the
    metrics exporter drains into Prometheus (thread-safe: fetch workers and the step write)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hist = {s: _Histogram() for s in STAGES}
        self._pending: list[tuple[Stage, float]] = []

    def observe(self, stage: Stage, seconds: float) -> None:
        with self._lock:
            self._hist[stage].observe(seconds)
            if len(self._pending) < PENDING_CAP:
                self._pending.append((stage, seconds))

    def drain(self) -> list[tuple[Stage, float]]:
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def report(self) -> dict[str, StageLatency]:
        with self._lock:
            return {
                s: StageLatency(
                    buckets=list(STAGE_BUCKETS), counts=list(h.counts), count=h.count, sum_s=h.total
                )
                for s, h in self._hist.items()
            }


def residency_view(
    slots: list[str], host: list[str], loading: list[str], disk: list[str]
) -> dict[str, Residency]:
    """Each known adapter's best tier (an adapter in a slot is usually also in host memory)."""
    view: dict[str, Residency] = {name: "disk" for name in disk}
    view.update({name: "loading" for name in loading})
    view.update({name: "host" for name in host})
    view.update({name: "slot" for name in slots})
    return dict(sorted(view.items()))


def residency_counts(view: dict[str, Residency]) -> dict[str, int]:
    """How many adapters are in each residency state (what Prometheus gets: bounded labels)."""
    counts = {state: 0 for state in ("slot", "host", "loading", "disk")}
    for state in view.values():
        counts[state] = counts.get(state, 0) + 1
    return counts
