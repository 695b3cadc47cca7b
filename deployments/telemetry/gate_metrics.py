"""Gate telemetry as Prometheus counters: routing entropy, top-1 weight and top-1 expert.

The engine folds them per composition and layer (`molora_runtime.engine.route_stats.gate_telemetry`); this
turns one stats interval's folds into counter increments. Histograms are exported as counters
with an `le` label, cumulative as Prometheus buckets are, so `histogram_quantile` reads them
and no token costs a Python call. Labels are bounded: composition names come from the
catalog, layers from the model, `le` from fixed bounds and adapters from the composition.
"""

from __future__ import annotations

from collections.abc import Callable

from deployments.telemetry import metric_names as names
from deployments.telemetry.metrics import metric as ray_metric
from molora_runtime.engine.route_stats.gate_telemetry import (
    ENTROPY_BUCKETS,
    TOP1_BUCKETS,
    LayerTelemetry,
)

Sample = tuple[str, dict[str, str], float]  # metric, tags, increment


def _le(bound: float) -> str:
    return f"{bound:g}"


def gate_samples(
    telemetry: dict[str, list[LayerTelemetry]],
    experts: Callable[[str], list[str]],
    label: Callable[[str], str] = str,
) -> list[Sample]:
    """Every nonzero increment of one interval. `experts`: a composition's adapter names;
    `label`: its label value (the catalog name without its version, so that publishing
    versions adds no series)."""
    out: list[Sample] = []
    for comp, layers in telemetry.items():
        adapters = experts(comp)
        for layer, t in enumerate(layers):
            if not t.tokens:
                continue
            base = {"composition": label(comp), "layer": str(layer)}
            for metric, bounds, counts in (
                (names.GATE_ENTROPY_BUCKETS, ENTROPY_BUCKETS, t.entropy_buckets),
                (names.GATE_TOP1_WEIGHT_BUCKETS, TOP1_BUCKETS, t.top1_weight_buckets),
            ):
                for bound, count in zip(bounds, counts, strict=True):
                    if count:
                        out.append((metric, {**base, "le": _le(bound)}, float(count)))
                out.append((metric, {**base, "le": "+Inf"}, float(t.tokens)))
            out.append((names.GATE_ENTROPY_SUM, base, t.entropy_sum))
            out.append((names.GATE_TOP1_WEIGHT_SUM, base, t.top1_weight_sum))
            for k, count in enumerate(t.top1_expert):
                if count:
                    adapter = adapters[k] if k < len(adapters) else str(k)
                    out.append((names.GATE_TOP1_TOKENS, {**base, "adapter": adapter}, float(count)))
    return out


def export_gate_telemetry(
    telemetry: dict[str, list[LayerTelemetry]],
    experts: Callable[[str], list[str]],
    label: Callable[[str], str] = str,
) -> None:
    for metric, tags, value in gate_samples(telemetry, experts, label):
        if value > 0:
            ray_metric(metric).inc(value, tags=tags)
