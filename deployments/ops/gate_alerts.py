"""The PrometheusRule that watches learned gates: a collapsed gate and a sudden routing shift.

Rendered into k8s/base by `molora k8s render` (the metric names come from `metric_names`, so a
rename cannot leave the rule querying nothing). Shares are of tokens by the expert their gate
ranks first, summed over layers, per composition, over `WINDOW`; `MIN_TOKENS` keeps an idle
composition quiet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deployments.telemetry import metric_names as m

RULE_NAME = "molora-gates"
WINDOW = "15m"
SHIFT_LOOKBACK = "1h"  # a shift compares the last window with the same window this long ago
COLLAPSE_SHARE = 0.95
SHIFT_SHARE = 0.3
SHIFT_ENTROPY = 0.25
MIN_TOKENS = 1000


def _increase(metric: str, by: str, offset: str = "", matchers: str = "") -> str:
    off = f" offset {offset}" if offset else ""
    return f"sum by ({by}) (increase({m.scraped(metric)}{matchers}[{WINDOW}]{off}))"


def expert_share(top1_sum_by: Callable[[str], str]) -> str:
    """Each expert's share of its composition's top-1 tokens, from `top1_sum_by(labels)`: the
    top-1 token counter (as a rate or an increase) summed by those labels."""
    return (
        f"{top1_sum_by('composition, adapter')}"
        f" / ignoring(adapter) group_left {top1_sum_by('composition')}"
    )


def _share(offset: str = "") -> str:
    """Each expert's share of its composition's top-1 tokens over the window."""
    return expert_share(lambda by: _increase(m.GATE_TOP1_TOKENS, by, offset))


def _busy(offset: str = "") -> str:
    return f"{_increase(m.GATE_TOP1_TOKENS, 'composition', offset)} >= {MIN_TOKENS}"


def _mean_entropy(offset: str = "") -> str:
    tokens = _increase(m.GATE_ENTROPY_BUCKETS, "composition", offset, '{le="+Inf"}')
    return f"{_increase(m.GATE_ENTROPY_SUM, 'composition', offset)} / {tokens}"


def collapsed_expr() -> str:
    return f"max by (composition) ({_share()}) > {COLLAPSE_SHARE} and on (composition) {_busy()}"


def shift_expr() -> str:
    now, before = _share(), _share(SHIFT_LOOKBACK)
    return (
        f"max by (composition) (abs(({now}) - ({before}))) > {SHIFT_SHARE}"
        f" and on (composition) {_busy()} and on (composition) {_busy(SHIFT_LOOKBACK)}"
    )


def entropy_shift_expr() -> str:
    now, before = _mean_entropy(), _mean_entropy(SHIFT_LOOKBACK)
    return (
        f"abs(({now}) - ({before})) > {SHIFT_ENTROPY}"
        f" and on (composition) {_busy()} and on (composition) {_busy(SHIFT_LOOKBACK)}"
    )


def rule_groups() -> list[dict[str, Any]]:
    """The `groups` of a Prometheus rule file (also what `promtool` checks)."""
    pct = f"{COLLAPSE_SHARE:.0%}"
    return [
        {
            "name": RULE_NAME,
            "rules": [
                {
                    "alert": "MoloraGateCollapsed",
                    "expr": collapsed_expr(),
                    "for": "10m",
                    "labels": {"severity": "warning"},
                    "annotations": {
                        "summary": "Learned gate of {{ $labels.composition }} collapsed",
                        "description": f"One expert is ranked first for more than {pct} of "
                        f"the tokens of composition {{{{ $labels.composition }}}} over {WINDOW} "
                        "({{ $value | humanizePercentage }}): the mixture serves as one adapter.",
                    },
                },
                {
                    "alert": "MoloraGateShift",
                    "expr": shift_expr(),
                    "for": "5m",
                    "labels": {"severity": "info"},
                    "annotations": {
                        "summary": "Routing of {{ $labels.composition }} shifted",
                        "description": "An expert's share of first-ranked tokens moved by "
                        "{{ $value | humanizePercentage }} against the same window "
                        f"{SHIFT_LOOKBACK} earlier: traffic or the gate changed.",
                    },
                },
                {
                    "alert": "MoloraGateEntropyShift",
                    "expr": entropy_shift_expr(),
                    "for": "5m",
                    "labels": {"severity": "info"},
                    "annotations": {
                        "summary": "Gate entropy of {{ $labels.composition }} shifted",
                        "description": "Mean normalized routing entropy moved by "
                        '{{ printf "%.2f" $value }} '
                        f"against the same window {SHIFT_LOOKBACK} earlier.",
                    },
                },
            ],
        }
    ]


def prometheus_rule(labels: dict[str, str]) -> dict[str, Any]:
    """The Prometheus Operator object (monitoring.coreos.com/v1 PrometheusRule)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": RULE_NAME, "labels": labels},
        "spec": {"groups": rule_groups()},
    }
