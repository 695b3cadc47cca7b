"""Grafana panel builders for the dashboard: time series and stat panels over `Query` targets."""

from __future__ import annotations

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import prometheus as prom_b
from grafana_foundation_sdk.builders import stat as stat_b
from grafana_foundation_sdk.builders import timeseries as ts_b
from grafana_foundation_sdk.models import common as common_m
from grafana_foundation_sdk.models import dashboard as dash_m

from deployments.ops.dashboard_promql import Query

DATASOURCE = dash_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
Row = tuple[str, list[ts_b.Panel | stat_b.Panel]]


def target(query: Query, ref_id: str) -> prom_b.Dataquery:
    return (
        prom_b.Dataquery()
        .expr(query.expr)
        .legend_format(query.legend)
        .ref_id(ref_id)
        .datasource(DATASOURCE)
        .range()
    )


def timeseries(
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
        panel = panel.with_target(target(query, chr(ord("A") + i)))
    return panel


def stat(title: str, description: str, unit: str, query: Query, *, width: int = 6) -> stat_b.Panel:
    return (
        stat_b.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .height(4)
        .span(width)
        .with_target(target(query, "A"))
    )
