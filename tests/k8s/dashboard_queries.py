"""What the dashboard queries: its targets and the metric names their expressions select."""

from __future__ import annotations

import re

from deployments.ops import dashboard_promql
from deployments.telemetry import metric_names as m

HISTOGRAMS = {
    m.TTFT, m.INTER_TOKEN, m.HOTSET_LOAD_LATENCY, m.LOAD_STAGE_LATENCY, m.GC_PAUSE,
    m.VLLM_QUEUE_TIME, m.VLLM_E2E, m.VLLM_TTFT, m.VLLM_ITL,
}  # fmt: skip


# Counted only when they happen, and Ray exports no counter before its first increment: a short
# end-to-end run may never see one.
# Accepted drafts too: a random tiny model may accept none of its n-gram drafts.
RARE = {
    m.scraped(n) for n in (m.VLLM_PREEMPTIONS, m.VLLM_SPEC_ACCEPTED, m.VLLM_SPEC_ACCEPTED_PER_POS)
}


def targets(board: dict) -> list[dict]:
    return [t for p in board["panels"] if p["type"] != "row" for t in p["targets"]]


def metric_names(expr: str) -> set[str]:
    """Identifiers followed by `{` in a PromQL expression (every selector here has matchers)."""
    return set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\{", expr))


def exported_names() -> set[str]:
    """What Prometheus can see: the project's metrics and Ray Serve's, histograms as _bucket."""
    names = set()
    for metric in (*m.ALL, *m.VLLM, *dashboard_promql.SERVE_METRICS):
        suffix = "_bucket" if metric in HISTOGRAMS else ""
        names.add(m.scraped(metric) + suffix)
    return names
