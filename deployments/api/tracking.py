"""Per-request metrics on the router: TTFT, inter-token gaps, e2e latency, token counts, final
status, as ours (`molora_*`) and vLLM's (`vllm_*`, served as `vllm:*`).

Labels are bounded by the catalog: a request is labelled by the adapter, composition or
configured route name it named, or else by its route kind (`mix`, `vocab`), never by a string
the caller built. `done` also runs the request's completion callbacks (quota lease, load).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from deployments.catalog.model_names import Resolved
from deployments.protocol.wire import DeltaItem, ReplicaItem, UsageItem
from deployments.telemetry import metric_names as names
from deployments.telemetry import metrics
from deployments.telemetry.histogram_batch import RECORDER, Labels


def route_label(resolved: Resolved, alias: str | None = None) -> str:
    """A bounded label for a request's route: the configured route name `alias` it was asked
    by, else its adapter or composition (a catalog name), else its kind."""
    return alias if alias is not None else resolved.route.label


class Tracker:
    """Per-request metrics: TTFT, inter-token gaps, e2e latency, tokens, final status."""

    def __init__(self, kind: str, label: str, model_name: str) -> None:
        self.kind, self.label = kind, label  # the route kind; the bounded adapter label
        self.model_name = model_name
        self.start = time.perf_counter()
        self.last: float | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.on_done: list[Any] = []  # callbacks (tokens_used, ok): quota lease, load estimate
        self._itl: list[tuple[Any, Labels]] = []  # inter-token histograms and their labels

    def on_item(self, item: ReplicaItem | dict[str, Any]) -> None:
        """Count one item: a typed item, or a delta still in its wire dict. Its latencies are
        held in the process's `RECORDER` (recorded in bulk), one value per token."""
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
        if self.last is None:
            self._first_token(now - self.start)
        else:
            gap = (now - self.last) / n
            for hist, labels in self._itl:
                RECORDER.add(hist, labels, gap, n)
            RECORDER.maybe_flush(now)
        self.last = now

    def _first_token(self, ttft: float) -> None:
        """TTFT, and the inter-token histograms and labels the request's later tokens use
        (the label is final by its first token)."""
        self._itl = []
        with contextlib.suppress(Exception):
            kind = (("route_kind", self.kind),)
            vllm = tuple(self.vllm_tags().items())
            RECORDER.add(metrics.ttft(), kind, ttft)
            RECORDER.add(metrics.vllm_router_histogram(names.VLLM_TTFT), vllm, ttft)
            self._itl = [
                (metrics.inter_token(), kind),
                (metrics.vllm_router_histogram(names.VLLM_ITL), vllm),
            ]

    def vllm_tags(self) -> dict[str, str]:
        """vLLM's `model_name` (the base model) and the bounded route label (none for base)."""
        lora = "" if self.kind == "base" else self.label
        return {"model_name": self.model_name, "lora_name": lora}

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
            vllm = self.vllm_tags()
            if status == "ok":
                e2e = time.perf_counter() - self.start
                metrics.vllm_router_histogram(names.VLLM_E2E).observe(e2e, tags=vllm)
            for name, count in (
                (names.VLLM_PROMPT_TOKENS, self.prompt_tokens),
                (names.VLLM_GENERATION_TOKENS, self.completion_tokens),
            ):
                if count:
                    metrics.vllm_router_counter(name).inc(count, tags=vllm)
        RECORDER.flush()
