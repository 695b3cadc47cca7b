"""Per-request metrics on the router: TTFT, inter-token gaps, token counts, final status.

`done` also runs the request's completion callbacks (the quota lease, the load estimate).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from deployments.catalog.model_names import Resolved
from deployments.ops import metrics
from deployments.placement.affinity import adapter_key
from deployments.replica.wire import DeltaItem, ReplicaItem, UsageItem


def route_label(resolved: Resolved) -> str:
    route = resolved.route
    if route.kind == "learned":
        return route.composition.split("@", 1)[0]  # type: ignore[union-attr]
    return adapter_key(resolved.placement_adapters) or "base"


class Tracker:
    """Per-request metrics: TTFT, inter-token gaps, tokens, final status."""

    def __init__(self, resolved: Resolved) -> None:
        self.kind = resolved.kind
        self.label = route_label(resolved)
        self.start = time.perf_counter()
        self.last: float | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.on_done: list[Any] = []  # callbacks (tokens_used, ok): quota lease, load estimate

    def on_item(self, item: ReplicaItem | dict[str, Any]) -> None:
        """Count one item: a typed item, or a delta still in its wire dict."""
        if isinstance(item, dict):
            n = len(item["token_ids"])
        elif isinstance(item, UsageItem):
            self.prompt_tokens = item.prompt_tokens
            self.completion_tokens = item.completion_tokens
            return
        elif isinstance(item, DeltaItem):
            n = len(item.token_ids)
        else:
            return
        if not n:
            return
        now = time.perf_counter()
        self.completion_tokens += n
        with contextlib.suppress(Exception):
            if self.last is None:
                metrics.ttft().observe(now - self.start, tags={"route_kind": self.kind})
            else:
                gap = (now - self.last) / n
                for _ in range(n):
                    metrics.inter_token().observe(gap, tags={"route_kind": self.kind})
        self.last = now

    def done(self, status: str) -> None:
        for callback in self.on_done:
            callback(self.prompt_tokens + self.completion_tokens, status == "ok")
        with contextlib.suppress(Exception):
            tags = {"route_kind": self.kind, "adapter": self.label}
            metrics.requests().inc(tags={**tags, "status": status})
            if self.prompt_tokens:
                metrics.tokens().inc(self.prompt_tokens, tags={**tags, "kind": "prompt"})
            if self.completion_tokens:
                metrics.tokens().inc(self.completion_tokens, tags={**tags, "kind": "completion"})
