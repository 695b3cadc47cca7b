"""Prometheus metrics exported through Ray (`ray.serve.metrics`), named in `metric_names`.

One table (`SPECS`) gives every metric its type, description, tags and buckets; `metric(name)`
makes each once per process, lazily, so importing this module costs nothing and unit tests
that never touch Ray never start it. The named functions are the call sites' short forms.
"""

from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple

from ray.serve import metrics as serve_metrics

from deployments.telemetry import metric_names as names

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
# vLLM's label names for `lora_requests_info` (vllm/v1/metrics/loggers.py), in its order
LORA_INFO_TAGS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")


class Spec(NamedTuple):
    """How one metric is made: its Ray type, help text, tag keys and (histograms) buckets."""

    kind: type[serve_metrics.Counter] | type[serve_metrics.Gauge] | type[serve_metrics.Histogram]
    description: str
    tags: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


_C, _G, _H = serve_metrics.Counter, serve_metrics.Gauge, serve_metrics.Histogram
HOTSET_COUNTERS = (
    names.HOTSET_HITS,
    names.HOTSET_MISSES,
    names.HOTSET_EVICTIONS,
    names.HOTSET_LOADS,
)
TIER_COUNTERS = {
    "hits": names.TIER_HITS,
    "misses": names.TIER_MISSES,
    "loads": names.TIER_LOADS,
    "evictions": names.TIER_EVICTIONS,
}
_GATE_TAGS = ("composition", "layer")

SPECS: dict[str, Spec] = {
    # the router's
    names.REQUESTS: Spec(
        _C,
        "requests by route kind, adapter (a catalog name or the route kind) and status",
        ("route_kind", "adapter", "status"),
    ),
    names.TOKENS: Spec(
        _C,
        "prompt and completion tokens by route kind and adapter",
        ("route_kind", "adapter", "kind"),
    ),
    names.TTFT: Spec(
        _H, "time to first token as the client sees it", ("route_kind",), LATENCY_BUCKETS
    ),
    names.INTER_TOKEN: Spec(_H, "time between streamed tokens", ("route_kind",), ITL_BUCKETS),
    names.PLACEMENTS: Spec(_C, "placement decisions of the adapter-affinity router", ("outcome",)),
    names.VLLM_E2E: Spec(
        _H, "Histogram of e2e request latency in seconds.", ROUTER_TAGS, VLLM_REQUEST_BUCKETS
    ),
    names.VLLM_TTFT: Spec(
        _H, "Histogram of time to first token in seconds.", ROUTER_TAGS, VLLM_TTFT_BUCKETS
    ),
    names.VLLM_ITL: Spec(
        _H, "Histogram of inter-token latency in seconds.", ROUTER_TAGS, VLLM_ITL_BUCKETS
    ),
    names.VLLM_PROMPT_TOKENS: Spec(_C, "Number of prefill tokens processed.", ROUTER_TAGS),
    names.VLLM_GENERATION_TOKENS: Spec(_C, "Number of generation tokens processed.", ROUTER_TAGS),
    # a model replica's
    names.QUEUE_LENGTH: Spec(_G, "waiting requests of a replica"),
    names.RUNNING: Spec(_G, "running requests of a replica"),
    **{n: Spec(_C, f"hot-set {n.split('_')[2]} of a replica") for n in HOTSET_COUNTERS},
    names.HOTSET_LOAD_LATENCY: Spec(
        _H, "seconds spent loading adapters into hot-set slots (mean per load)", (), LOAD_BUCKETS
    ),
    names.HOTSET_SLOTS_USED: Spec(_G, "occupied hot-set slots"),
    names.GATE_TOKENS: Spec(
        _C,
        "tokens routed to each expert, per layer, by learned compositions",
        (*_GATE_TAGS, "adapter"),
    ),
    names.GATE_ENTROPY_BUCKETS: Spec(
        _C,
        "routed tokens whose gate entropy (0 one-hot .. 1 uniform) is <= le",
        (*_GATE_TAGS, "le"),
    ),
    names.GATE_ENTROPY_SUM: Spec(_C, "sum of routed tokens' normalized gate entropy", _GATE_TAGS),
    names.GATE_TOP1_WEIGHT_BUCKETS: Spec(
        _C, "routed tokens whose first expert's mixture weight is <= le", (*_GATE_TAGS, "le")
    ),
    names.GATE_TOP1_WEIGHT_SUM: Spec(
        _C, "sum of routed tokens' first-expert mixture weight", _GATE_TAGS
    ),
    names.GATE_TOP1_TOKENS: Spec(
        _C, "routed tokens whose gate ranked this expert first", (*_GATE_TAGS, "adapter")
    ),
    **{
        n: Spec(_C, f"adapter-tier {what} of a replica, by tier", ("tier",))
        for what, n in TIER_COUNTERS.items()
    },
    names.TIER_BYTES: Spec(_G, "bytes held by each adapter tier", ("tier",)),
    names.TIER_ADAPTERS: Spec(
        _G, "adapters per residency state (slot, host, loading, disk) of a replica", ("state",)
    ),
    names.LOAD_STAGE_LATENCY: Spec(
        _H,
        "seconds per adapter load stage: fetch (store to disk), parse, copy (to slot)",
        ("stage",),
        LOAD_BUCKETS,
    ),
    names.ADAPTER_RESIDENCY: Spec(
        _G,
        "adapters in a hot-set slot or parsed in host memory, by public name (a tenant's "
        "adapters read `private`), rank and pin",
        ("adapter", "tier", "rank", "pinned"),
    ),
    names.VLLM_RUNNING: Spec(_G, "Number of requests in model execution batches.", REPLICA_TAGS),
    names.VLLM_WAITING: Spec(_G, "Number of requests waiting to be processed.", REPLICA_TAGS),
    names.VLLM_KV_USAGE: Spec(_G, "KV-cache usage. 1 means 100 percent usage.", REPLICA_TAGS),
    names.VLLM_PREFIX_QUERIES: Spec(
        _C, "Prefix cache queries, in terms of number of queried tokens.", REPLICA_TAGS
    ),
    names.VLLM_PREFIX_HITS: Spec(
        _C, "Prefix cache hits, in terms of number of cached tokens.", REPLICA_TAGS
    ),
    names.VLLM_PREEMPTIONS: Spec(
        _C, "Cumulative number of preemption from the engine.", REPLICA_TAGS
    ),
    names.VLLM_QUEUE_TIME: Spec(
        _H,
        "Histogram of time spent in WAITING phase for request.",
        REPLICA_TAGS,
        VLLM_REQUEST_BUCKETS,
    ),
    names.VLLM_LORA_INFO: Spec(_G, "Running stats on lora requests.", LORA_INFO_TAGS),
    names.VLLM_SPEC_DRAFTS: Spec(_C, "Number of spec decoding drafts.", REPLICA_TAGS),
    names.VLLM_SPEC_DRAFT_TOKENS: Spec(_C, "Number of draft tokens.", REPLICA_TAGS),
    names.VLLM_SPEC_ACCEPTED: Spec(_C, "Number of accepted tokens.", REPLICA_TAGS),
    names.VLLM_SPEC_ACCEPTED_PER_POS: Spec(
        _C, "Accepted tokens per draft position.", (*REPLICA_TAGS, "position")
    ),
    names.SPEC_TOKENS: Spec(
        _C,
        "speculative decoding's draft and accepted tokens by route kind and adapter or "
        "composition (public names; a tenant's read `private`)",
        ("route_kind", "adapter", "kind"),
    ),
    # every process
    names.GC_PAUSE: Spec(
        _H,
        "seconds the process stood still in one garbage collection (GIL held)",
        ("generation",),
        GC_BUCKETS,
    ),
}


@cache
def metric(name: str) -> Any:
    """This process's metric `name`, made from its spec on first use."""
    kind, description, tags, buckets = SPECS[name]
    if buckets:
        return kind(name, description=description, boundaries=list(buckets), tag_keys=tags)
    return kind(name, description=description, tag_keys=tags)


# The call sites' names: one per metric, and `metric` itself for the families they index.
hotset_counter = tier_counter = vllm_router_histogram = vllm_router_counter = metric
vllm_replica_gauge = vllm_replica_counter = metric


def requests() -> serve_metrics.Counter:
    return metric(names.REQUESTS)


def tokens() -> serve_metrics.Counter:
    return metric(names.TOKENS)


def ttft() -> serve_metrics.Histogram:
    return metric(names.TTFT)


def inter_token() -> serve_metrics.Histogram:
    return metric(names.INTER_TOKEN)


def placements() -> serve_metrics.Counter:
    return metric(names.PLACEMENTS)


def queue_length() -> serve_metrics.Gauge:
    return metric(names.QUEUE_LENGTH)


def running() -> serve_metrics.Gauge:
    return metric(names.RUNNING)


def hotset_load_latency() -> serve_metrics.Histogram:
    return metric(names.HOTSET_LOAD_LATENCY)


def hotset_slots_used() -> serve_metrics.Gauge:
    return metric(names.HOTSET_SLOTS_USED)


def gate_tokens() -> serve_metrics.Counter:
    return metric(names.GATE_TOKENS)


def tier_bytes() -> serve_metrics.Gauge:
    return metric(names.TIER_BYTES)


def tier_adapters() -> serve_metrics.Gauge:
    return metric(names.TIER_ADAPTERS)


def load_stage_latency() -> serve_metrics.Histogram:
    return metric(names.LOAD_STAGE_LATENCY)


def vllm_queue_time() -> serve_metrics.Histogram:
    return metric(names.VLLM_QUEUE_TIME)


def vllm_lora_info() -> serve_metrics.Gauge:
    return metric(names.VLLM_LORA_INFO)


def adapter_residency() -> serve_metrics.Gauge:
    return metric(names.ADAPTER_RESIDENCY)


def gc_pause() -> serve_metrics.Histogram:
    return metric(names.GC_PAUSE)


def record_gc_pause(generation: int, seconds: float) -> None:
    """`heap.GcPauseMeter`'s sink."""
    gc_pause().observe(seconds, tags={"generation": str(generation)})
