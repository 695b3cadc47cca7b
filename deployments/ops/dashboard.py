"""The MoLoRA Grafana dashboard, built in code so every query names a metric we really export.

Queries are written from the constants in `deployments.ops.metric_names` (plus Ray Serve's own replica
and autoscaling gauges), never typed by hand, so a renamed metric breaks the build and the tests
instead of silently emptying a panel. `molora dashboards build` writes the JSON that is committed
under `k8s/grafana/`; `molora dashboards push` uploads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import prometheus as prom_b
from grafana_foundation_sdk.builders import stat as stat_b
from grafana_foundation_sdk.builders import timeseries as ts_b
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_m
from grafana_foundation_sdk.models import dashboard as dash_m

from deployments.ops import metric_names as m
from deployments.ops.dashboard_gates import gate_drift_row

DASHBOARD_UID = "molora-serve"
DASHBOARD_TITLE = "MoLoRA Serve"
REPO_ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_PATH = Path("k8s") / "grafana" / "molora-dashboard.json"

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

DATASOURCE = dash_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "[$__rate_interval]"
APP = 'application=~"$application"'
QUANTILES = (0.5, 0.9, 0.99)


def _name(metric: str) -> str:
    return m.scraped(metric)


def _sel(metric: str, *matchers: str, suffix: str = "") -> str:
    """`ray_<metric><suffix>{application=~"$application", ...}`."""
    return _name(metric) + suffix + "{" + ", ".join((APP, *matchers)) + "}"


def _rate(metric: str, *matchers: str, suffix: str = "") -> str:
    return f"rate({_sel(metric, *matchers, suffix=suffix)}{RATE})"


def _quantile(q: float, histogram: str, by: str = "") -> str:
    labels = ", ".join(("le", by)) if by else "le"
    return f"histogram_quantile({q}, sum by ({labels}) ({_rate(histogram, suffix='_bucket')}))"


@dataclass(frozen=True)
class Query:
    """One PromQL target and how its series are labelled in the legend."""

    expr: str
    legend: str


def _target(query: Query, ref_id: str) -> prom_b.Dataquery:
    return (
        prom_b.Dataquery()
        .expr(query.expr)
        .legend_format(query.legend)
        .ref_id(ref_id)
        .datasource(DATASOURCE)
        .range()
    )


def _timeseries(
    title: str,
    description: str,
    unit: str,
    queries: list[Query],
    *,
    width: int = 12,
    stack: bool = False,
) -> ts_b.Panel:
    panel = (
        ts_b.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .height(8)
        .span(width)
        .fill_opacity(10)
        .legend(
            common_b.VizLegendOptions()
            .show_legend(True)
            .display_mode(common_m.LegendDisplayMode.TABLE)
            .placement(common_m.LegendPlacement.BOTTOM)
        )
    )
    if stack:
        panel = panel.stacking(common_b.StackingConfig().mode(common_m.StackingMode.NORMAL))
    for i, query in enumerate(queries):
        panel = panel.with_target(_target(query, chr(ord("A") + i)))
    return panel


def _stat(title: str, description: str, unit: str, query: Query, *, width: int = 6) -> stat_b.Panel:
    return (
        stat_b.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .height(4)
        .span(width)
        .with_target(_target(query, "A"))
    )


def _percentiles(histogram: str, by: str) -> list[Query]:
    return [
        Query(_quantile(q, histogram, by), f"p{round(q * 100)} {{{{{by}}}}}") for q in QUANTILES
    ]


def _hit_rate() -> str:
    hits = f"sum({_rate(m.HOTSET_HITS)})"
    misses = f"sum({_rate(m.HOTSET_MISSES)})"
    return f"{hits} / clamp_min({hits} + {misses}, 1e-9)"


def _full_collections() -> str:
    """Generation-2 collections per second (the histogram's `+Inf` bucket counts them all)."""
    return _rate(m.GC_PAUSE, 'generation="2"', 'le="+Inf"', suffix="_bucket")


def _tier_hit_rate() -> str:
    hits = f"sum by (tier) ({_rate(m.TIER_HITS)})"
    misses = f"sum by (tier) ({_rate(m.TIER_MISSES)})"
    return f"{hits} / clamp_min({hits} + {misses}, 1e-9)"


def _variables() -> list[dash_b.DatasourceVariable | dash_b.QueryVariable]:
    datasource = dash_b.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
    application = (
        dash_b.QueryVariable("application")
        .label("Serve application")
        .datasource(dash_m.DataSourceRef(type_val="prometheus", uid="${datasource}"))
        .query(f"label_values({_name(m.REQUESTS)}, application)")
        .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .include_all(True)
        .all_value(".*")
        .multi(True)
    )
    adapter = (
        dash_b.QueryVariable("adapter")
        .label("Adapter")
        .datasource(dash_m.DataSourceRef(type_val="prometheus", uid="${datasource}"))
        .query(f"label_values({_name(m.REQUESTS)}, adapter)")
        .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .include_all(True)
        .all_value(".*")
        .multi(True)
    )
    return [datasource, application, adapter]


def _rows() -> list[tuple[str, list[ts_b.Panel | stat_b.Panel]]]:
    adapter = 'adapter=~"$adapter"'
    completion = 'kind="completion"'
    return [
        (
            "Overview",
            [
                _stat(
                    "Requests / s",
                    "All requests answered by the router, any status.",
                    "reqps",
                    Query(f"sum({_rate(m.REQUESTS)})", "requests/s"),
                ),
                _stat(
                    "Completion tokens / s",
                    "Generated tokens over all adapters.",
                    "short",
                    Query(f"sum({_rate(m.TOKENS, completion)})", "tokens/s"),
                ),
                _stat(
                    "Hot-set hit rate",
                    "Share of adapter look-ups served from a resident slot.",
                    "percentunit",
                    Query(_hit_rate(), "hit rate"),
                ),
                _stat(
                    "Healthy replicas",
                    "Replicas passing Serve health checks, summed over deployments.",
                    "short",
                    Query(f"sum({_sel(SERVE_REPLICAS_HEALTHY)})", "replicas"),
                ),
            ],
        ),
        (
            "Traffic",
            [
                _timeseries(
                    "Requests by adapter and route kind",
                    "Request rate split by the adapter named in `model` and the route kind.",
                    "reqps",
                    [
                        Query(
                            f"sum by (adapter, route_kind) ({_rate(m.REQUESTS, adapter)})",
                            "{{adapter}} / {{route_kind}}",
                        )
                    ],
                    stack=True,
                ),
                _timeseries(
                    "Requests by status",
                    "Request rate by outcome; non-`ok` statuses are client or server errors.",
                    "reqps",
                    [
                        Query(
                            f"sum by (status) ({_rate(m.REQUESTS, adapter)})",
                            "{{status}}",
                        )
                    ],
                ),
                _timeseries(
                    "Tokens by adapter and route kind",
                    "Prompt and completion tokens per second.",
                    "short",
                    [
                        Query(
                            f"sum by (adapter, route_kind, kind) ({_rate(m.TOKENS, adapter)})",
                            "{{adapter}} / {{route_kind}} / {{kind}}",
                        )
                    ],
                    stack=True,
                ),
                _timeseries(
                    "Placement outcomes",
                    "affinity: replica already held the adapters; spill: load bound moved it; "
                    "new: no replica held them.",
                    "ops",
                    [Query(f"sum by (outcome) ({_rate(m.PLACEMENTS)})", "{{outcome}}")],
                ),
            ],
        ),
        (
            "Latency",
            [
                _timeseries(
                    "Time to first token",
                    "p50 / p90 / p99 by route kind.",
                    "s",
                    _percentiles(m.TTFT, "route_kind"),
                ),
                _timeseries(
                    "Inter-token latency",
                    "p50 / p90 / p99 gap between streamed tokens, by route kind.",
                    "s",
                    _percentiles(m.INTER_TOKEN, "route_kind"),
                ),
            ],
        ),
        (
            "Scheduler",
            [
                _timeseries(
                    "Queue depth",
                    "Requests waiting for a batch slot, per replica.",
                    "short",
                    [Query(f"sum by (replica) ({_sel(m.QUEUE_LENGTH)})", "{{replica}}")],
                ),
                _timeseries(
                    "Running requests",
                    "Sequences in the running batch, per replica.",
                    "short",
                    [Query(f"sum by (replica) ({_sel(m.RUNNING)})", "{{replica}}")],
                ),
            ],
        ),
        (
            "Adapter hot-set",
            [
                _timeseries(
                    "Hit rate",
                    "hits / (hits + misses) over all replicas.",
                    "percentunit",
                    [Query(_hit_rate(), "hit rate")],
                    width=8,
                ),
                _timeseries(
                    "Loads and evictions",
                    "Adapters brought into a slot and pushed out of one (LRU).",
                    "ops",
                    [
                        Query(f"sum({_rate(m.HOTSET_LOADS)})", "loads"),
                        Query(f"sum({_rate(m.HOTSET_EVICTIONS)})", "evictions"),
                    ],
                    width=8,
                ),
                _timeseries(
                    "Slots in use",
                    "Occupied adapter slots per replica.",
                    "short",
                    [Query(f"sum by (replica) ({_sel(m.HOTSET_SLOTS_USED)})", "{{replica}}")],
                    width=8,
                ),
                _timeseries(
                    "Adapter load latency",
                    "p50 / p90 / p99 time to bring an adapter from the store cache into a slot.",
                    "s",
                    [
                        Query(_quantile(q, m.HOTSET_LOAD_LATENCY), f"p{round(q * 100)}")
                        for q in QUANTILES
                    ],
                    width=24,
                ),
            ],
        ),
        (
            "Adapter tiers",
            [
                _timeseries(
                    "Hit rate by tier",
                    "hits / (hits + misses) of the slot, host-memory and disk tiers.",
                    "percentunit",
                    [Query(_tier_hit_rate(), "{{tier}}")],
                    width=8,
                ),
                _timeseries(
                    "Tier loads and evictions",
                    "Adapters brought into and pushed out of each tier (LRU; pinned stay).",
                    "ops",
                    [
                        Query(f"sum by (tier) ({_rate(m.TIER_LOADS)})", "loads {{tier}}"),
                        Query(f"sum by (tier) ({_rate(m.TIER_EVICTIONS)})", "evictions {{tier}}"),
                    ],
                    width=8,
                ),
                _timeseries(
                    "Tier bytes",
                    "Bytes each tier holds, summed over replicas.",
                    "bytes",
                    [Query(f"sum by (tier) ({_sel(m.TIER_BYTES)})", "{{tier}}")],
                    width=8,
                ),
                _timeseries(
                    "Adapters by residency",
                    "How many adapters are in a slot, parsed in host memory, loading, or only "
                    "on disk, summed over replicas.",
                    "short",
                    [Query(f"sum by (state) ({_sel(m.TIER_ADAPTERS)})", "{{state}}")],
                    width=12,
                ),
                _timeseries(
                    "Load latency by stage",
                    "p50 / p90 / p99 of each load stage: fetch (store to disk), parse, copy.",
                    "s",
                    _percentiles(m.LOAD_STAGE_LATENCY, "stage"),
                    width=12,
                ),
            ],
        ),
        (
            "Learned router",
            [
                _timeseries(
                    "Gate share per adapter",
                    "Share of routed tokens each expert adapter receives, per composition "
                    "(summed over layers).",
                    "percentunit",
                    [
                        Query(
                            f"sum by (composition, adapter) ({_rate(m.GATE_TOKENS)})"
                            " / ignoring(adapter) group_left "
                            f"sum by (composition) ({_rate(m.GATE_TOKENS)})",
                            "{{composition}} / {{adapter}}",
                        )
                    ],
                    stack=True,
                ),
                _timeseries(
                    "Gate tokens per layer",
                    "Routed tokens per second by layer, to spot layers whose gate collapsed.",
                    "short",
                    [
                        Query(
                            f"sum by (composition, layer) ({_rate(m.GATE_TOKENS)})",
                            "{{composition}} / layer {{layer}}",
                        )
                    ],
                ),
            ],
        ),
        gate_drift_row(),
        (
            "Replicas and autoscaling",
            [
                _timeseries(
                    "Replicas vs. autoscaling target",
                    "Healthy replicas next to the target the Serve autoscaler is moving to, "
                    "and its raw decision before min/max bounds.",
                    "short",
                    [
                        Query(
                            f"sum by (deployment) ({_sel(SERVE_REPLICAS_HEALTHY)})",
                            "healthy {{deployment}}",
                        ),
                        Query(
                            f"max by (deployment) ({_sel(SERVE_TARGET_REPLICAS)})",
                            "target {{deployment}}",
                        ),
                        Query(
                            f"max by (deployment) ({_sel(SERVE_DESIRED_REPLICAS)})",
                            "desired {{deployment}}",
                        ),
                    ],
                    width=24,
                ),
            ],
        ),
        (
            "Garbage collector",
            [
                _timeseries(
                    "GC pause",
                    "p50 / p90 / p99 of one garbage collection in a router or model replica, "
                    "by generation; the process holds the GIL throughout (no step, no token).",
                    "s",
                    _percentiles(m.GC_PAUSE, "generation"),
                ),
                _timeseries(
                    "Full collections",
                    "Generation-2 collections per second, per replica. Each replica's first is "
                    "Ray Serve's own at start-up, before it freezes the start-up heap.",
                    "ops",
                    [Query(f"sum by (replica) ({_full_collections()})", "{{replica}}")],
                ),
            ],
        ),
    ]


def build_dashboard() -> dash_m.Dashboard:
    """The dashboard model (grafana-foundation-sdk), rows laid out top to bottom."""
    builder = (
        dash_b.Dashboard(DASHBOARD_TITLE)
        .uid(DASHBOARD_UID)
        .description("Requests, latency, adapter hot-set, learned router and autoscaling.")
        .tags(["molora", "ray-serve", "llm"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .tooltip(dash_m.DashboardCursorSync.CROSSHAIR)
        .variables(_variables())
    )
    panel_id = 0
    for title, panels in _rows():
        panel_id += 1
        builder = builder.with_row(dash_b.Row(title).id(panel_id))
        for panel in panels:
            panel_id += 1
            builder = builder.with_panel(panel.id(panel_id))
    return builder.build()


def dashboard_json() -> dict:
    """The dashboard as the plain JSON object Grafana stores."""
    return json.loads(json.dumps(build_dashboard(), cls=JSONEncoder))


def render(dashboard: dict) -> str:
    """Stable text form (sorted keys, trailing newline) so the committed file diffs cleanly."""
    return json.dumps(dashboard, indent=2, sort_keys=True) + "\n"


def write(path: Path) -> Path:
    """Write the dashboard JSON to `path` (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(dashboard_json()))
    return path
