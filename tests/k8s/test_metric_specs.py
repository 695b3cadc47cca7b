"""Every exported metric name has exactly one spec (type, help, tags, buckets) in `metrics.SPECS`."""

from __future__ import annotations

from deployments.telemetry import metric_names as names
from deployments.telemetry import metrics


def test_every_exported_name_has_one_spec() -> None:
    assert set(metrics.SPECS) == {*names.ALL, *names.VLLM}
    for name, spec in metrics.SPECS.items():
        assert spec.description, name
        is_histogram = spec.kind is metrics.serve_metrics.Histogram
        assert is_histogram == bool(spec.buckets), name
        assert list(spec.buckets) == sorted(spec.buckets), name
