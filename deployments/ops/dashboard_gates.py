"""The dashboard's "Gate drift" row: routing entropy, top-1 weight and top-1 expert share over time.

Kept apart from `dashboard` (which only adds the row) so the gate panels live beside the gate
metrics they read (`gate_metrics`); the entropy and top-1 weight histograms are cumulative
`le` counters, read with `histogram_quantile` like any Prometheus histogram.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import prometheus as prom_b
from grafana_foundation_sdk.builders import timeseries as ts_b
from grafana_foundation_sdk.models import common as common_m
from grafana_foundation_sdk.models import dashboard as dash_m

from deployments.ops import metric_names as m

TITLE = "Gate drift"
_DATASOURCE = dash_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
_APP = 'application=~"$application"'
_RATE = "[$__rate_interval]"
_SHIFT = "1h"  # the drift panel's baseline: the same rate this long ago


def _rate(metric: str, offset: str = "") -> str:
    off = f" offset {offset}" if offset else ""
    return f"rate({m.scraped(metric)}{{{_APP}}}{_RATE}{off})"


def _quantile(q: float, buckets: str, by: str) -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) ({_rate(buckets)}))"


def _mean(total: str, buckets: str, by: str) -> str:
    count = f'rate({m.scraped(buckets)}{{{_APP}, le="+Inf"}}{_RATE})'
    return f"sum by ({by}) ({_rate(total)}) / sum by ({by}) ({count})"


def _share(offset: str = "") -> str:
    top1 = m.GATE_TOP1_TOKENS
    return (
        f"sum by (composition, adapter) ({_rate(top1, offset)})"
        f" / ignoring(adapter) group_left sum by (composition) ({_rate(top1, offset)})"
    )


def _panel(
    title: str, description: str, unit: str, queries: list[tuple[str, str]], *, stack: bool = False
) -> ts_b.Panel:
    panel = (
        ts_b.Panel()
        .title(title)
        .description(description)
        .datasource(_DATASOURCE)
        .unit(unit)
        .height(8)
        .span(12)
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
    for i, (expr, legend) in enumerate(queries):
        target = (
            prom_b.Dataquery()
            .expr(expr)
            .legend_format(legend)
            .ref_id(chr(ord("A") + i))
            .datasource(_DATASOURCE)
            .range()
        )
        panel = panel.with_target(target)
    return panel


def gate_drift_row() -> tuple[str, list[ts_b.Panel]]:
    """The row's title and panels, in the dashboard's `(title, panels)` row form."""
    ent, w = m.GATE_ENTROPY_BUCKETS, m.GATE_TOP1_WEIGHT_BUCKETS
    return TITLE, [
        _panel(
            "Routing entropy",
            "Median and p90 of the gate's normalized entropy per composition: 0 sends every "
            "token to one expert, 1 spreads it evenly. A fall towards 0 is a collapsing gate.",
            "none",
            [
                (_quantile(0.5, ent, "composition"), "p50 {{composition}}"),
                (_quantile(0.9, ent, "composition"), "p90 {{composition}}"),
            ],
        ),
        _panel(
            "Mean routing entropy by layer",
            "Mean normalized gate entropy per composition and layer, to find the layers whose "
            "gate collapsed or never learned to route.",
            "none",
            [(_mean(m.GATE_ENTROPY_SUM, ent, "composition, layer"), "{{composition}} / {{layer}}")],
        ),
        _panel(
            "Top-1 weight",
            "Median and p10 of the mixture weight a token gives its first expert (1 at top-1): "
            "near 1 the mixture behaves as one adapter, near 1/k it blends evenly.",
            "percentunit",
            [
                (_quantile(0.5, w, "composition"), "p50 {{composition}}"),
                (_quantile(0.1, w, "composition"), "p10 {{composition}}"),
                (_mean(m.GATE_TOP1_WEIGHT_SUM, w, "composition"), "mean {{composition}}"),
            ],
        ),
        _panel(
            "Top-1 expert share",
            "Share of each composition's tokens whose gate ranks this expert first (summed over "
            "layers); the collapse alert fires above 95% for one expert.",
            "percentunit",
            [(_share(), "{{composition}} / {{adapter}}")],
            stack=True,
        ),
        _panel(
            "Top-1 share drift",
            f"Each expert's top-1 share now minus its share {_SHIFT} earlier: a sudden move is a "
            "change of traffic or of the gate (the shift alert fires beyond 30 points).",
            "percentunit",
            [(f"({_share()}) - ({_share(_SHIFT)})", "{{composition}} / {{adapter}}")],
        ),
    ]
