"""Dashboard rows for the cluster: replicas against the autoscaler, garbage-collector pauses."""

from __future__ import annotations

from deployments.ops.dashboard_panels import Panel, Row
from deployments.ops.dashboard_promql import (
    SERVE_DESIRED_REPLICAS,
    SERVE_REPLICAS_HEALTHY,
    SERVE_TARGET_REPLICAS,
    full_collections,
    grouped,
    percentiles,
    sel,
    split_by,
)
from deployments.telemetry import metric_names as m


def rows() -> list[Row]:
    """The rows of this concern, top to bottom."""
    return [
        (
            "Replicas and autoscaling",
            [
                Panel(
                    "Replicas vs. autoscaling target",
                    "Healthy replicas next to the target the Serve autoscaler is moving to, "
                    "and its raw decision before min/max bounds.",
                    "short",
                    [
                        *grouped("deployment", {"healthy": sel(SERVE_REPLICAS_HEALTHY)}),
                        *grouped(
                            "deployment",
                            {
                                "target": sel(SERVE_TARGET_REPLICAS),
                                "desired": sel(SERVE_DESIRED_REPLICAS),
                            },
                            agg="max",
                        ),
                    ],
                    width=24,
                ),
            ],
        ),
        (
            "Garbage collector",
            [
                Panel(
                    "GC pause",
                    "p50 / p90 / p99 of one garbage collection in a router or model replica, "
                    "by generation; the process holds the GIL throughout (no step, no token).",
                    "s",
                    percentiles(m.GC_PAUSE, "generation"),
                ),
                Panel(
                    "Full collections",
                    "Generation-2 collections per second, per replica. Each replica's first is "
                    "Ray Serve's own at start-up, before it freezes the start-up heap.",
                    "ops",
                    split_by("replica", full_collections()),
                ),
            ],
        ),
    ]
