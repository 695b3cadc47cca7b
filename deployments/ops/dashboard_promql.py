"""PromQL for the dashboard, written from the exported metric names so a rename breaks the build.

Selectors scope every query to the `$application` variable; Ray adds the `ray_` prefix when it
scrapes (`metric_names.scraped`).
"""

from __future__ import annotations

from dataclasses import dataclass

from deployments.telemetry import metric_names as m

# Ray Serve's own controller gauges (Ray 2.60, `ray/serve/_private/deployment_state.py`,
# `autoscaling_state.py`), tagged {application, deployment}; Ray adds the `ray_` prefix.
SERVE_REPLICAS_HEALTHY = "serve_deployment_replica_healthy"
SERVE_TARGET_REPLICAS = "serve_autoscaling_target_replicas"
SERVE_DESIRED_REPLICAS = "serve_autoscaling_desired_replicas"
SERVE_METRICS: tuple[str, ...] = (
    SERVE_REPLICAS_HEALTHY,
    SERVE_TARGET_REPLICAS,
    SERVE_DESIRED_REPLICAS,
)

RATE = "[$__rate_interval]"
APP = 'application=~"$application"'
QUANTILES = (0.5, 0.9, 0.99)


def sel(metric: str, *matchers: str, suffix: str = "") -> str:
    """`ray_<metric><suffix>{application=~"$application", ...}`."""
    return m.scraped(metric) + suffix + "{" + ", ".join((APP, *matchers)) + "}"


def rate(metric: str, *matchers: str, suffix: str = "", offset: str = "") -> str:
    """The per-second rate of `metric`, `offset` back in time when given."""
    off = f" offset {offset}" if offset else ""
    return f"rate({sel(metric, *matchers, suffix=suffix)}{RATE}{off})"


def quantile(q: float, histogram: str, by: str = "", suffix: str = "_bucket") -> str:
    """The `q` quantile of a histogram whose `le` buckets are `histogram + suffix`."""
    labels = ", ".join(("le", by)) if by else "le"
    return f"histogram_quantile({q}, sum by ({labels}) ({rate(histogram, suffix=suffix)}))"


@dataclass(frozen=True)
class Query:
    """One PromQL target and how its series are labelled in the legend."""

    expr: str
    legend: str


def grouped(by: str, series: dict[str, str], agg: str = "sum") -> list[Query]:
    """One `agg by (by) (expr)` target per named series, in the legend the name then the `by`
    labels (`agg(expr)` and the bare name when `by` is empty)."""
    if not by:
        return [Query(f"{agg}({expr})", name) for name, expr in series.items()]
    labels = " / ".join("{{" + label.strip() + "}}" for label in by.split(","))
    return [
        Query(f"{agg} by ({by}) ({expr})", f"{name} {labels}".lstrip())
        for name, expr in series.items()
    ]


def split_by(by: str, expr: str, agg: str = "sum") -> list[Query]:
    """One series of `expr` per value of the `by` labels (`grouped` with one unnamed series)."""
    return grouped(by, {"": expr}, agg)


def percentiles(
    histogram: str, by: str, quantiles: tuple[float, ...] = QUANTILES, suffix: str = "_bucket"
) -> list[Query]:
    """One target per quantile of `histogram` (as `quantile`), legends `p50 {{by}}` and so on."""
    legend = f" {{{{{by}}}}}" if by else ""
    return [
        Query(quantile(q, histogram, by, suffix), f"p{round(q * 100)}{legend}") for q in quantiles
    ]


def hit_rate(hits: str = m.HOTSET_HITS, misses: str = m.HOTSET_MISSES, by: str = "") -> str:
    """hits / (hits + misses) over every replica (per `by` label when given); the hot-set's by
    default."""
    agg = f"sum by ({by}) " if by else "sum"
    summed_hits = f"{agg}({rate(hits)})"
    return f"{summed_hits} / clamp_min({summed_hits} + {agg}({rate(misses)}), 1e-9)"


def full_collections() -> str:
    """Generation-2 collections per second (the histogram's `+Inf` bucket counts them all)."""
    return rate(m.GC_PAUSE, 'generation="2"', 'le="+Inf"', suffix="_bucket")
