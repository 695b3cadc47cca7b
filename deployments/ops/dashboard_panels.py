"""Dashboard panels as data (`Panel`) and the one builder that makes Grafana panels of them."""

from __future__ import annotations

from typing import NamedTuple

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import prometheus as prom_b
from grafana_foundation_sdk.builders import stat as stat_b
from grafana_foundation_sdk.builders import timeseries as ts_b
from grafana_foundation_sdk.models import common as common_m
from grafana_foundation_sdk.models import dashboard as dash_m

from deployments.ops.dashboard_promql import Query

DATASOURCE = dash_m.DataSourceRef(type_val="prometheus", uid="${datasource}")


def target(query: Query, ref_id: str) -> prom_b.Dataquery:
    return (
        prom_b.Dataquery()
        .expr(query.expr)
        .legend_format(query.legend)
        .ref_id(ref_id)
        .datasource(DATASOURCE)
        .range()
    )


class Panel(NamedTuple):
    """One panel as data: what it shows and where; `build` turns every panel into Grafana's.

    A `stat` panel shows one number (4 high, a quarter of the width by default); any other
    panel is a time series (8 high, half the width by default)."""

    title: str
    description: str
    unit: str
    queries: list[Query]
    width: int = 0  # columns of 24; 0: the kind's default
    stack: bool = False
    stat: bool = False


Row = tuple[str, list[Panel]]


def build(panel: Panel) -> ts_b.Panel | stat_b.Panel:
    """The Grafana panel of `panel`: its targets lettered A, B, ... in order."""
    builder: ts_b.Panel | stat_b.Panel
    if panel.stat:
        builder = stat_b.Panel().height(4).span(panel.width or 6)
    else:
        builder = (
            ts_b.Panel()
            .height(8)
            .span(panel.width or 12)
            .fill_opacity(10)
            .legend(
                common_b.VizLegendOptions()
                .show_legend(True)
                .display_mode(common_m.LegendDisplayMode.TABLE)
                .placement(common_m.LegendPlacement.BOTTOM)
            )
        )
        if panel.stack:
            builder = builder.stacking(common_b.StackingConfig().mode(common_m.StackingMode.NORMAL))
    builder = (
        builder.title(panel.title)
        .description(panel.description)
        .datasource(DATASOURCE)
        .unit(panel.unit)
    )
    for i, query in enumerate(panel.queries):
        builder = builder.with_target(target(query, chr(ord("A") + i)))
    return builder
