"""Dashboard rows for serving traffic: overview, request and token rates, latency, the scheduler."""

from __future__ import annotations

from deployments.ops import metric_names as m
from deployments.ops.dashboard_panels import Row, stat, timeseries
from deployments.ops.dashboard_promql import (
    SERVE_REPLICAS_HEALTHY,
    Query,
    grouped,
    hit_rate,
    percentiles,
    rate,
    sel,
)


def rows() -> list[Row]:
    """The rows of this concern, top to bottom."""
    adapter = 'adapter=~"$adapter"'
    completion = 'kind="completion"'
    return [
        (
            "Overview",
            [
                stat(
                    "Requests / s",
                    "All requests answered by the router, any status.",
                    "reqps",
                    Query(f"sum({rate(m.REQUESTS)})", "requests/s"),
                ),
                stat(
                    "Completion tokens / s",
                    "Generated tokens over all adapters.",
                    "short",
                    Query(f"sum({rate(m.TOKENS, completion)})", "tokens/s"),
                ),
                stat(
                    "Hot-set hit rate",
                    "Share of adapter look-ups served from a resident slot.",
                    "percentunit",
                    Query(hit_rate(), "hit rate"),
                ),
                stat(
                    "Healthy replicas",
                    "Replicas passing Serve health checks, summed over deployments.",
                    "short",
                    Query(f"sum({sel(SERVE_REPLICAS_HEALTHY)})", "replicas"),
                ),
            ],
        ),
        (
            "Traffic",
            [
                timeseries(
                    "Requests by adapter and route kind",
                    "Request rate split by the adapter named in `model` and the route kind.",
                    "reqps",
                    grouped("adapter, route_kind", {"": rate(m.REQUESTS, adapter)}),
                    stack=True,
                ),
                timeseries(
                    "Requests by status",
                    "Request rate by outcome; non-`ok` statuses are client or server errors.",
                    "reqps",
                    grouped("status", {"": rate(m.REQUESTS, adapter)}),
                ),
                timeseries(
                    "Tokens by adapter and route kind",
                    "Prompt and completion tokens per second.",
                    "short",
                    grouped("adapter, route_kind, kind", {"": rate(m.TOKENS, adapter)}),
                    stack=True,
                ),
                timeseries(
                    "Placement outcomes",
                    "affinity: replica already held the adapters; spill: load bound moved it; "
                    "new: no replica held them.",
                    "ops",
                    grouped("outcome", {"": rate(m.PLACEMENTS)}),
                ),
            ],
        ),
        (
            "Latency",
            [
                timeseries(
                    "Time to first token",
                    "p50 / p90 / p99 by route kind.",
                    "s",
                    percentiles(m.TTFT, "route_kind"),
                ),
                timeseries(
                    "Inter-token latency",
                    "p50 / p90 / p99 gap between streamed tokens, by route kind.",
                    "s",
                    percentiles(m.INTER_TOKEN, "route_kind"),
                ),
            ],
        ),
        (
            "Scheduler",
            [
                timeseries(
                    "Queue depth",
                    "Requests waiting for a batch slot, per replica.",
                    "short",
                    grouped("replica", {"": sel(m.QUEUE_LENGTH)}),
                ),
                timeseries(
                    "Running requests",
                    "Sequences in the running batch, per replica.",
                    "short",
                    grouped("replica", {"": sel(m.RUNNING)}),
                ),
            ],
        ),
    ]
