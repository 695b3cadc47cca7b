"""The dashboard's "Gate drift" row: routing entropy, top-1 weight and top-1 expert share over time.

Kept apart so the gate panels live beside the gate
metrics they read (`gate_metrics`); the entropy and top-1 weight histograms are cumulative
`le` counters, read with `histogram_quantile` like any Prometheus histogram.
"""

from __future__ import annotations

from deployments.ops.dashboard_panels import Panel, Row
from deployments.ops.dashboard_promql import Query, percentiles, rate
from deployments.ops.gate_alerts import expert_share
from deployments.telemetry import metric_names as m

TITLE = "Gate drift"
_SHIFT = "1h"  # the drift panel's baseline: the same rate this long ago


def _mean(total: str, buckets: str, by: str) -> str:
    count = rate(buckets, 'le="+Inf"')
    return f"sum by ({by}) ({rate(total)}) / sum by ({by}) ({count})"


def _share(offset: str = "") -> str:
    return expert_share(lambda by: f"sum by ({by}) ({rate(m.GATE_TOP1_TOKENS, offset=offset)})")


def rows() -> list[Row]:
    """The "Gate drift" row."""
    ent, w = m.GATE_ENTROPY_BUCKETS, m.GATE_TOP1_WEIGHT_BUCKETS
    return [
        (
            TITLE,
            [
                Panel(
                    "Routing entropy",
                    "Median and p90 of the gate's normalized entropy per composition: 0 sends every "
                    "token to one expert, 1 spreads it evenly. A fall towards 0 is a collapsing gate.",
                    "none",
                    percentiles(ent, "composition", (0.5, 0.9), suffix=""),
                ),
                Panel(
                    "Mean routing entropy by layer",
                    "Mean normalized gate entropy per composition and layer, to find the layers whose "
                    "gate collapsed or never learned to route.",
                    "none",
                    [
                        Query(
                            _mean(m.GATE_ENTROPY_SUM, ent, "composition, layer"),
                            "{{composition}} / {{layer}}",
                        )
                    ],
                ),
                Panel(
                    "Top-1 weight",
                    "Median and p10 of the mixture weight a token gives its first expert (1 at top-1): "
                    "near 1 the mixture behaves as one adapter, near 1/k it blends evenly.",
                    "percentunit",
                    [
                        *percentiles(w, "composition", (0.5, 0.1), suffix=""),
                        Query(
                            _mean(m.GATE_TOP1_WEIGHT_SUM, w, "composition"), "mean {{composition}}"
                        ),
                    ],
                ),
                Panel(
                    "Top-1 expert share",
                    "Share of each composition's tokens whose gate ranks this expert first (summed over "
                    "layers); the collapse alert fires above 95% for one expert.",
                    "percentunit",
                    [Query(_share(), "{{composition}} / {{adapter}}")],
                    stack=True,
                ),
                Panel(
                    "Top-1 share drift",
                    f"Each expert's top-1 share now minus its share {_SHIFT} earlier: a sudden move is a "
                    "change of traffic or of the gate (the shift alert fires beyond 30 points).",
                    "percentunit",
                    [Query(f"({_share()}) - ({_share(_SHIFT)})", "{{composition}} / {{adapter}}")],
                ),
            ],
        )
    ]
