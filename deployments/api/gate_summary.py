"""The `molora.gate_summary` option: refused off learned routes, shaped per choice for clients.

A route without a gate has nothing to summarize, so asking for one is a 400 rather than a
silently missing field: it usually means the model name resolved to something the caller did
not mean. Names are shown as the caller knows them (no tenant namespace).
"""

from __future__ import annotations

from typing import Any

from adapter_store.names import plain_name
from deployments.api.http_errors import ApiError
from deployments.api.response_models import ExpertShareOut, GateSummaryOut
from deployments.catalog.model_names import Resolved
from deployments.protocol.wire import GateSummaryItem


def check_gate_summary(body: Any, resolved: Resolved) -> None:
    """A 400 when the request asks for a gate summary on a route without a learned gate."""
    if body.molora.gate_summary and not resolved.route.is_learned:
        raise ApiError(
            400,
            f"molora.gate_summary needs a learned composition, but model {body.model!r} routes "
            f"as {resolved.kind!r}, which has no gate: name a composition or give "
            "molora.route of kind 'learned'",
            "molora.gate_summary",
        )


def gate_summary_out(index: int, summary: dict[str, Any]) -> dict[str, Any]:
    """One choice's summary (a wire `GateSummaryItem` dict) as the response shows it, dumped."""
    item = GateSummaryItem.model_validate(summary)
    name, _, version = plain_name(item.composition).partition("@")
    return GateSummaryOut(
        index=index,
        composition=name,
        version=version or None,
        tokens=item.tokens,
        layers=item.layers,
        experts=[
            ExpertShareOut(adapter=plain_name(e), share=s, mean_weight=w)
            for e, s, w in zip(item.experts, item.share, item.mean_weight, strict=True)
        ],
        mean_entropy=item.mean_entropy,
        layer_top1_share=item.layer_top1_share,
    ).model_dump(exclude_none=True)


def choice_summaries(
    deltas: dict[int, list[dict[str, Any]]], order: list[int]
) -> list[dict[str, Any]] | None:
    """The summaries of the returned choices (`order`: engine choice per response index)."""
    out = [
        gate_summary_out(i, d["gate_summary"])
        for i, choice in enumerate(order)
        for d in deltas[choice]
        if d.get("gate_summary") is not None
    ]
    return out or None
