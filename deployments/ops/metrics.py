"""Prometheus metrics exported through Ray (`ray.serve.metrics`), named in `metric_names`.

Each process creates its metrics once, lazily, so importing this module costs nothing and
unit tests that never touch Ray never start it.
"""

from __future__ import annotations

from functools import cache

from ray.serve import metrics as serve_metrics

from deployments.ops import metric_names as names

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
GC_BUCKETS = [0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]
LOAD_BUCKETS = [0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


@cache
def requests() -> serve_metrics.Counter:
    return serve_metrics.Counter(
        names.REQUESTS,
        description="requests by route kind, adapter (model name) and status",
        tag_keys=("route_kind", "adapter", "status"),
    )


@cache
def tokens() -> serve_metrics.Counter:
    return serve_metrics.Counter(
        names.TOKENS,
        description="prompt and completion tokens by route kind and adapter",
        tag_keys=("route_kind", "adapter", "kind"),
    )


@cache
def ttft() -> serve_metrics.Histogram:
    return serve_metrics.Histogram(
        names.TTFT,
        description="time to first token as the client sees it",
        boundaries=LATENCY_BUCKETS,
        tag_keys=("route_kind",),
    )


@cache
def inter_token() -> serve_metrics.Histogram:
    return serve_metrics.Histogram(
        names.INTER_TOKEN,
        description="time between streamed tokens",
        boundaries=ITL_BUCKETS,
        tag_keys=("route_kind",),
    )


@cache
def queue_length() -> serve_metrics.Gauge:
    return serve_metrics.Gauge(names.QUEUE_LENGTH, description="waiting requests of a replica")


@cache
def running() -> serve_metrics.Gauge:
    return serve_metrics.Gauge(names.RUNNING, description="running requests of a replica")


@cache
def hotset_counter(name: str) -> serve_metrics.Counter:
    return serve_metrics.Counter(name, description=f"hot-set {name.split('_')[2]} of a replica")


@cache
def hotset_load_latency() -> serve_metrics.Histogram:
    return serve_metrics.Histogram(
        names.HOTSET_LOAD_LATENCY,
        description="seconds spent loading adapters into hot-set slots (mean per load)",
        boundaries=LOAD_BUCKETS,
    )


@cache
def hotset_slots_used() -> serve_metrics.Gauge:
    return serve_metrics.Gauge(names.HOTSET_SLOTS_USED, description="occupied hot-set slots")


@cache
def gate_tokens() -> serve_metrics.Counter:
    return serve_metrics.Counter(
        names.GATE_TOKENS,
        description="tokens routed to each expert, per layer, by learned compositions",
        tag_keys=("composition", "layer", "adapter"),
    )


@cache
def placements() -> serve_metrics.Counter:
    return serve_metrics.Counter(
        names.PLACEMENTS,
        description="placement decisions of the adapter-affinity router",
        tag_keys=("outcome",),
    )


TIER_COUNTERS = {
    "hits": names.TIER_HITS,
    "misses": names.TIER_MISSES,
    "loads": names.TIER_LOADS,
    "evictions": names.TIER_EVICTIONS,
}


@cache
def tier_counter(name: str) -> serve_metrics.Counter:
    what = name.removeprefix("molora_tier_").removesuffix("_total")
    return serve_metrics.Counter(
        name, description=f"adapter-tier {what} of a replica, by tier", tag_keys=("tier",)
    )


@cache
def tier_bytes() -> serve_metrics.Gauge:
    return serve_metrics.Gauge(
        names.TIER_BYTES, description="bytes held by each adapter tier", tag_keys=("tier",)
    )


@cache
def tier_adapters() -> serve_metrics.Gauge:
    return serve_metrics.Gauge(
        names.TIER_ADAPTERS,
        description="adapters per residency state (slot, host, loading, disk) of a replica",
        tag_keys=("state",),
    )


@cache
def load_stage_latency() -> serve_metrics.Histogram:
    return serve_metrics.Histogram(
        names.LOAD_STAGE_LATENCY,
        description="seconds per adapter load stage: fetch (store to disk), parse, copy (to slot)",
        boundaries=LOAD_BUCKETS,
        tag_keys=("stage",),
    )


@cache
def gc_pause() -> serve_metrics.Histogram:
    return serve_metrics.Histogram(
        names.GC_PAUSE,
        description="seconds the process stood still in one garbage collection (GIL held)",
        boundaries=GC_BUCKETS,
        tag_keys=("generation",),
    )


def record_gc_pause(generation: int, seconds: float) -> None:
    """`heap.GcPauseMeter`'s sink."""
    gc_pause().observe(seconds, tags={"generation": str(generation)})
