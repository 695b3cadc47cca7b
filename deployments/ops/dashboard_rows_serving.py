"""Dashboard rows for serving traffic: overview, request and token rates, latency, the scheduler."""

from __future__ import annotations

from deployments.ops.dashboard_panels import Panel, Row
from deployments.ops.dashboard_promql import (
    SERVE_REPLICAS_HEALTHY,
    Query,
    hit_rate,
    percentiles,
    rate,
    sel,
    split_by,
)
from deployments.telemetry import metric_names as m


def rows() -> list[Row]:
    """The rows of this concern, top to bottom."""
    adapter = 'adapter=~"$adapter"'
    completion = 'kind="completion"'
    return [
        (
            "Overview",
            [
                Panel(
                    "Requests / s",
                    "All requests answered by the router, any status.",
                    "reqps",
                    [Query(f"sum({rate(m.REQUESTS)})", "requests/s")],
                    stat=True,
                ),
                Panel(
                    "Completion tokens / s",
                    "Generated tokens over all adapters.",
                    "short",
                    [Query(f"sum({rate(m.TOKENS, completion)})", "tokens/s")],
                    stat=True,
                ),
                Panel(
                    "Hot-set hit rate",
                    "Share of adapter look-ups served from a resident slot.",
                    "percentunit",
                    [Query(hit_rate(), "hit rate")],
                    stat=True,
                ),
                Panel(
                    "Healthy replicas",
                    "Replicas passing Serve health checks, summed over deployments.",
                    "short",
                    [Query(f"sum({sel(SERVE_REPLICAS_HEALTHY)})", "replicas")],
                    stat=True,
                ),
            ],
        ),
        (
            "Traffic",
            [
                Panel(
                    "Requests by adapter and route kind",
                    "Request rate split by the adapter named in `model` and the route kind.",
                    "reqps",
                    split_by("adapter, route_kind", rate(m.REQUESTS, adapter)),
                    stack=True,
                ),
                Panel(
                    "Requests by status",
                    "Request rate by outcome; non-`ok` statuses are client or server errors.",
                    "reqps",
                    split_by("status", rate(m.REQUESTS, adapter)),
                ),
                Panel(
                    "Tokens by adapter and route kind",
                    "Prompt and completion tokens per second.",
                    "short",
                    split_by("adapter, route_kind, kind", rate(m.TOKENS, adapter)),
                    stack=True,
                ),
                Panel(
                    "Placement outcomes",
                    "affinity: replica already held the adapters; spill: load bound moved it; "
                    "new: no replica held them.",
                    "ops",
                    split_by("outcome", rate(m.PLACEMENTS)),
                ),
            ],
        ),
        (
            "Latency",
            [
                Panel(
                    "Time to first token",
                    "p50 / p90 / p99 by route kind.",
                    "s",
                    percentiles(m.TTFT, "route_kind"),
                ),
                Panel(
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
                Panel(
                    "Queue depth",
                    "Requests waiting for a batch slot, per replica.",
                    "short",
                    split_by("replica", sel(m.QUEUE_LENGTH)),
                ),
                Panel(
                    "Running requests",
                    "Sequences in the running batch, per replica.",
                    "short",
                    split_by("replica", sel(m.RUNNING)),
                ),
            ],
        ),
    ]
