"""Prometheus metrics exported through Ray (`ray.serve.metrics`), named in `metric_names`.

Each process creates its metrics once, lazily, so importing this module costs nothing and
unit tests that never touch Ray never start it. Three cached factories (`counter`, `gauge`,
`histogram`) make every metric; the named functions below only fix each one's description,
labels and buckets.
"""

from __future__ import annotations

from functools import cache

from ray.serve import metrics as serve_metrics

from deployments.ops import metric_names as names

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
GC_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# vLLM's own boundaries (vllm/v1/metrics/buckets.py), so its dashboards read ours unchanged
VLLM_REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip

ROUTER_TAGS = ("model_name", "lora_name")  # vLLM's model_name; lora_name a catalog name or kind
REPLICA_TAGS = ("model_name",)


@cache
def counter(name: str, description: str, tag_keys: tuple[str, ...] = ()) -> serve_metrics.Counter:
    return serve_metrics.Counter(name, description=description, tag_keys=tag_keys)


@cache
def gauge(name: str, description: str, tag_keys: tuple[str, ...] = ()) -> serve_metrics.Gauge:
    return serve_metrics.Gauge(name, description=description, tag_keys=tag_keys)


@cache
def histogram(
    name: str, description: str, buckets: tuple[float, ...], tag_keys: tuple[str, ...] = ()
) -> serve_metrics.Histogram:
    return serve_metrics.Histogram(
        name, description=description, boundaries=list(buckets), tag_keys=tag_keys
    )


# -- the router's ----------------------------------------------------------------------------


def requests() -> serve_metrics.Counter:
    return counter(
        names.REQUESTS,
        "requests by route kind, adapter (a catalog name or the route kind) and status",
        ("route_kind", "adapter", "status"),
    )


def tokens() -> serve_metrics.Counter:
    return counter(
        names.TOKENS,
        "prompt and completion tokens by route kind and adapter",
        ("route_kind", "adapter", "kind"),
    )


def ttft() -> serve_metrics.Histogram:
    return histogram(
        names.TTFT, "time to first token as the client sees it", LATENCY_BUCKETS, ("route_kind",)
    )


def inter_token() -> serve_metrics.Histogram:
    return histogram(
        names.INTER_TOKEN, "time between streamed tokens", ITL_BUCKETS, ("route_kind",)
    )


def placements() -> serve_metrics.Counter:
    return counter(
        names.PLACEMENTS, "placement decisions of the adapter-affinity router", ("outcome",)
    )


VLLM_ROUTER_DOCS = {
    names.VLLM_E2E: ("Histogram of e2e request latency in seconds.", VLLM_REQUEST_BUCKETS),
    names.VLLM_TTFT: ("Histogram of time to first token in seconds.", VLLM_TTFT_BUCKETS),
    names.VLLM_ITL: ("Histogram of inter-token latency in seconds.", VLLM_ITL_BUCKETS),
}


def vllm_router_histogram(name: str) -> serve_metrics.Histogram:
    description, buckets = VLLM_ROUTER_DOCS[name]
    return histogram(name, description, buckets, ROUTER_TAGS)


def vllm_router_counter(name: str) -> serve_metrics.Counter:
    what = "prefill" if name == names.VLLM_PROMPT_TOKENS else "generation"
    return counter(name, f"Number of {what} tokens processed.", ROUTER_TAGS)


# -- a model replica's ------------------------------------------------------------------------


def queue_length() -> serve_metrics.Gauge:
    return gauge(names.QUEUE_LENGTH, "waiting requests of a replica")


def running() -> serve_metrics.Gauge:
    return gauge(names.RUNNING, "running requests of a replica")


def hotset_counter(name: str) -> serve_metrics.Counter:
    return counter(name, f"hot-set {name.split('_')[2]} of a replica")


def hotset_load_latency() -> serve_metrics.Histogram:
    return histogram(
        names.HOTSET_LOAD_LATENCY,
        "seconds spent loading adapters into hot-set slots (mean per load)",
        LOAD_BUCKETS,
    )


def hotset_slots_used() -> serve_metrics.Gauge:
    return gauge(names.HOTSET_SLOTS_USED, "occupied hot-set slots")


def gate_tokens() -> serve_metrics.Counter:
    return counter(
        names.GATE_TOKENS,
        "tokens routed to each expert, per layer, by learned compositions",
        ("composition", "layer", "adapter"),
    )


TIER_COUNTERS = {
    "hits": names.TIER_HITS,
    "misses": names.TIER_MISSES,
    "loads": names.TIER_LOADS,
    "evictions": names.TIER_EVICTIONS,
}


def tier_counter(name: str) -> serve_metrics.Counter:
    what = name.removeprefix("molora_tier_").removesuffix("_total")
    return counter(name, f"adapter-tier {what} of a replica, by tier", ("tier",))


def tier_bytes() -> serve_metrics.Gauge:
    return gauge(names.TIER_BYTES, "bytes held by each adapter tier", ("tier",))


def tier_adapters() -> serve_metrics.Gauge:
    return gauge(
        names.TIER_ADAPTERS,
        "adapters per residency state (slot, host, loading, disk) of a replica",
        ("state",),
    )


def load_stage_latency() -> serve_metrics.Histogram:
    return histogram(
        names.LOAD_STAGE_LATENCY,
        "seconds per adapter load stage: fetch (store to disk), parse, copy (to slot)",
        LOAD_BUCKETS,
        ("stage",),
    )


VLLM_REPLICA_DOCS = {
    names.VLLM_RUNNING: "Number of requests in model execution batches.",
    names.VLLM_WAITING: "Number of requests waiting to be processed.",
    names.VLLM_KV_USAGE: "KV-cache usage. 1 means 100 percent usage.",
    names.VLLM_PREFIX_QUERIES: "Prefix cache queries, in terms of number of queried tokens.",
    names.VLLM_PREFIX_HITS: "Prefix cache hits, in terms of number of cached tokens.",
    names.VLLM_PREEMPTIONS: "Cumulative number of preemption from the engine.",
}


def vllm_replica_gauge(name: str) -> serve_metrics.Gauge:
    return gauge(name, VLLM_REPLICA_DOCS[name], REPLICA_TAGS)


def vllm_replica_counter(name: str) -> serve_metrics.Counter:
    return counter(name, VLLM_REPLICA_DOCS[name], REPLICA_TAGS)


def vllm_queue_time() -> serve_metrics.Histogram:
    return histogram(
        names.VLLM_QUEUE_TIME,
        "Histogram of time spent in WAITING phase for request.",
        VLLM_REQUEST_BUCKETS,
        REPLICA_TAGS,
    )


# -- every process ---------------------------------------------------------------------------


def gc_pause() -> serve_metrics.Histogram:
    return histogram(
        names.GC_PAUSE,
        "seconds the process stood still in one garbage collection (GIL held)",
        GC_BUCKETS,
        ("generation",),
    )


def record_gc_pause(generation: int, seconds: float) -> None:
    """`heap.GcPauseMeter`'s sink."""
    gc_pause().observe(seconds, tags={"generation": str(generation)})
