"""Seeded traffic for the placement simulator (benchmarks/placement_sim.py).

Poisson arrivals at one rate; each request names one adapter drawn from a Zipf popularity over
the catalog. Popularity is a seeded permutation of the adapters, so a name says nothing about
its rank. Two events test what a steady Zipf does not:

- a flash crowd: one adapter that was cold (far down the popularity order) takes a fixed share
  of all requests for a while, more than one replica can serve;
- a diurnal shift: the popularity order is redrawn, so the adapters that were hot go cold and
  every replica's hot-set has to turn over.

Every policy is run on the same arrivals, so differences come from placement alone.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class Phase(BaseModel):
    """A named span of simulated time; results are reported per phase."""

    model_config = ConfigDict(frozen=True)

    name: str
    start_s: float
    end_s: float

    @property
    def minutes(self) -> float:
        return (self.end_s - self.start_s) / 60.0


class TrafficConfig(BaseModel):
    """The catalog, its popularity and the timeline of phases (seconds of simulated time)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    adapters: int = Field(1000, ge=1)
    zipf_s: float = Field(1.1, gt=0)
    ranks: tuple[int, ...] = (8, 16, 32, 64)
    seed: int = 0
    warmup_s: float = Field(120.0, ge=0, description="not counted: hot-sets fill")
    steady_s: float = Field(480.0, gt=0)
    flash_s: float = Field(60.0, gt=0)
    recovery_s: float = Field(180.0, gt=0, description="after the flash crowd, before the shift")
    shift_s: float = Field(360.0, gt=0, description="after the popularity order is redrawn")
    flash_share: float = Field(0.3, gt=0, lt=1, description="of all requests, in the flash crowd")
    flash_popularity: int = Field(
        900, ge=0, description="popularity index (0 = hottest) of the flash adapter before it"
    )

    def phases(self) -> list[Phase]:
        spans = [
            ("warmup", self.warmup_s),
            ("steady", self.steady_s),
            ("flash", self.flash_s),
            ("recovery", self.recovery_s),
            ("shift", self.shift_s),
        ]
        out, t = [], 0.0
        for name, length in spans:
            if length > 0:
                out.append(Phase(name=name, start_s=t, end_s=t + length))
                t += length
        return out


@dataclass(frozen=True)
class Arrival:
    t: float
    adapter: str
    phase: str


@dataclass(frozen=True)
class Traffic:
    """Arrivals in time order, the catalog's ranks and the adapters the checks look at."""

    arrivals: list[Arrival]
    ranks: dict[str, int]
    phases: list[Phase]
    flash_adapter: str
    top_before: str  # hottest adapter before the shift
    top_after: str  # hottest adapter after it
    zipf_top_share: float  # the hottest adapter's share of the Zipf draw


def adapter_name(i: int) -> str:
    return f"a{i:04d}"


def zipf_weights(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1, dtype=float) ** s
    return w / w.sum()


def make_traffic(cfg: TrafficConfig, rate_per_s: float) -> Traffic:
    """Draw every arrival up front (seeded), so each policy sees the identical request stream."""
    rng = np.random.default_rng(cfg.seed)
    n = cfg.adapters
    ranks = {adapter_name(i): int(r) for i, r in enumerate(rng.choice(cfg.ranks, size=n))}
    before = rng.permutation(n)  # before[k] = adapter at popularity index k
    after = rng.permutation(n)
    flash = int(before[min(cfg.flash_popularity, n - 1)])
    weights = zipf_weights(n, cfg.zipf_s)
    phases = cfg.phases()
    arrivals: list[Arrival] = []
    for phase in phases:
        span = phase.end_s - phase.start_s
        count = int(rng.poisson(rate_per_s * span))
        times = np.sort(rng.uniform(phase.start_s, phase.end_s, size=count))
        popularity = rng.choice(n, size=count, p=weights)
        order = after if phase.name == "shift" else before
        ids = order[popularity]
        if phase.name == "flash":
            ids = np.where(rng.random(count) < cfg.flash_share, flash, ids)
        arrivals.extend(
            Arrival(float(t), adapter_name(int(i)), phase.name)
            for t, i in zip(times, ids, strict=True)
        )
    return Traffic(
        arrivals=arrivals,
        ranks=ranks,
        phases=phases,
        flash_adapter=adapter_name(flash),
        top_before=adapter_name(int(before[0])),
        top_after=adapter_name(int(after[0])),
        zipf_top_share=float(weights[0]),
    )


def cache_bounds(traffic: Traffic, slots: int, phases: tuple[str, ...]) -> dict[str, float]:
    """Misses per minute over `phases` of all replicas' slots as one cache (no adapter held
    twice, nothing pinned) on this trace. A replica hits only what its own slots hold, so
    `belady` (evict the adapter needed furthest ahead: the offline optimum) bounds every
    placement. `pooled_lru` is that cache under the hot-sets' own eviction, LRU; a placement
    beats it only by keeping rarely used adapters from evicting others. `static_hindsight`
    holds each phase's `slots` most requested adapters of that phase (loading each once)."""
    seq = [a.adapter for a in traffic.arrivals]
    counted = [a.phase in phases for a in traffic.arrivals]
    minutes = sum(p.minutes for p in traffic.phases if p.name in phases)
    nxt, last = [0] * len(seq), {}
    for i in range(len(seq) - 1, -1, -1):
        nxt[i] = last.get(seq[i], len(seq))
        last[seq[i]] = i
    held: dict[str, int] = {}
    heap: list[tuple[int, str]] = []
    belady = 0
    for i, a in enumerate(seq):
        if a not in held:
            belady += counted[i]
            while len(held) >= slots:
                neg, b = heapq.heappop(heap)
                if held.get(b) == -neg:
                    del held[b]
        held[a] = nxt[i]
        heapq.heappush(heap, (-nxt[i], a))
    lru: OrderedDict[str, None] = OrderedDict()
    pooled = 0
    for i, a in enumerate(seq):
        if a in lru:
            lru.move_to_end(a)
            continue
        pooled += counted[i]
        lru[a] = None
        if len(lru) > slots:
            lru.popitem(last=False)
    static = 0
    for phase in phases:
        names = [a.adapter for a in traffic.arrivals if a.phase == phase]
        top = {n for n, _ in Counter(names).most_common(slots)}
        static += sum(n not in top for n in names) + len(top)
    return {
        "slots": slots,
        "belady_per_min": round(belady / minutes, 1),
        "pooled_lru_per_min": round(pooled / minutes, 1),
        "static_hindsight_per_min": round(static / minutes, 1),
    }


def phase_popularity(cfg: TrafficConfig, phase: str) -> np.ndarray:
    """The request probabilities of a phase, most requested first (the order's permutation,
    which only names the adapters, does not change them)."""
    weights = zipf_weights(cfg.adapters, cfg.zipf_s)
    if phase == "flash":
        weights = (1 - cfg.flash_share) * weights
        weights[min(cfg.flash_popularity, cfg.adapters - 1)] += cfg.flash_share
    return np.sort(weights)[::-1]


def irm_bound(cfg: TrafficConfig, traffic: Traffic, slots: int, phases: tuple[str, ...]) -> float:
    """Misses per minute over `phases` that any online cache of `slots` adapters must expect.

    Within a phase each request draws its adapter independently of the past, so whatever a
    cache holds when it arrives, it hits with probability at most the `slots` most requested
    adapters' share (the independent reference model; its optimum keeps those). The bound is
    that, times the phase's requests; it ignores the loads when popularity turns over, slots
    held by running requests and copies of one adapter on several replicas, so every
    placement's slot loads lie above it in expectation."""
    counts = Counter(a.phase for a in traffic.arrivals if a.phase in phases)
    minutes = sum(p.minutes for p in traffic.phases if p.name in phases)
    missed = 0.0
    for phase, n in counts.items():
        top = float(phase_popularity(cfg, phase)[:slots].sum())
        missed += n * (1 - top)
    return round(missed / minutes, 1)
