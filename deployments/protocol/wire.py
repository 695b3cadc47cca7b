"""What a model replica streams to the ingress: one typed item per message, never a bare dict.

The replica encodes with `encode` (a model, dumped once) and the ingress decodes with `decode`
(one `validate_python` per item), so a field cannot be dropped by a misspelt key. Items:
- `info`: first, which replica serves the request, whether its adapters were hot, and whether
  the items after the first output come through the router's stream channel;
- `delta`: the text and token ids of one or more new tokens (several when the replica coalesces
  an engine step's outputs) of choice `index` (0 .. n-1), their optional attribution and
  logprobs, and the finish reason (and the asked gate summary) on that choice's last;
- `usage`: token counts, once, before the stream ends (completion tokens of every choice);
- `error`: the request failed; status and message are what the client sees.

`approx_size` bounds what one message may carry: the channel splits its batches below the
transport's limit, and an item too large to send fails its own request only.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class _Item(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InfoItem(_Item):
    type: Literal["info"] = "info"
    replica: str
    hot_set_hit: bool
    tier: str | None = Field(
        None,
        description="where the request's adapters were on arrival: slot|host|loading|disk|store",
    )
    channel: bool = Field(
        False,
        description="the items after the first output come through the router's stream channel "
        "(deployments/replica/stream_channel.py), not this call",
    )


class TokenAttributionItem(_Item):
    token_id: int
    adapters: dict[str, float]


class GateSummaryItem(_Item):
    """A learned route's gate over one choice's generated tokens (`engine.types.GateSummary`)."""

    composition: str
    experts: list[str]
    tokens: int = Field(ge=0)
    layers: int = Field(ge=0)
    share: list[float]
    mean_weight: list[float]
    mean_entropy: float
    layer_top1_share: list[list[float]] | None = None


class TopLogprobItem(_Item):
    token_id: int
    token: str = Field(description="the token's text (decoded alone)")
    logprob: float = Field(description="-inf for a masked token")


class LogprobItem(_Item):
    token_id: int
    token: str
    logprob: float | None = Field(description="None only for the first prompt token")
    top: list[TopLogprobItem] = Field(default_factory=list)


class DeltaItem(_Item):
    type: Literal["delta"] = "delta"
    index: int = Field(0, ge=0, description="the choice (n > 1)")
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    attribution: list[TokenAttributionItem] | None = Field(
        None, description="one entry per token of token_ids, when requested"
    )
    logprobs: list[LogprobItem] | None = Field(
        None, description="one entry per token of token_ids, when requested"
    )
    prompt_logprobs: list[LogprobItem] | None = Field(
        None, description="every prompt token (echo), once, on the choice's first delta"
    )
    finish_reason: Literal["stop", "length", "abort"] | None = Field(
        None, description="set on the request's last delta"
    )
    stop_reason: str | int | None = Field(
        None, description="with finish_reason stop: the stop string or stop token id matched"
    )
    gate_summary: GateSummaryItem | None = Field(
        None, description="on the choice's last delta, when asked (learned routes)"
    )


class UsageItem(_Item):
    type: Literal["usage"] = "usage"
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)


class ErrorItem(_Item):
    type: Literal["error"] = "error"
    status: int = Field(ge=400, le=599)
    message: str
    param: str | None = None


ReplicaItem: TypeAlias = Annotated[
    InfoItem | DeltaItem | UsageItem | ErrorItem, Field(discriminator="type")
]
_ITEM: TypeAdapter[InfoItem | DeltaItem | UsageItem | ErrorItem] = TypeAdapter(ReplicaItem)


# Serve's inter-deployment gRPC refuses messages over 4 MiB; a channel message aims for
# MESSAGE_BYTES and no single item may pass ITEM_BYTES (its request fails alone instead).
MESSAGE_BYTES = 1 << 20
ITEM_BYTES = 2 << 20


def _logprob_bytes(entries: list[dict[str, object]] | None) -> int:
    if not entries:
        return 0
    total = 0
    for entry in entries:
        top = entry.get("top") or []
        total += 64 + len(str(entry.get("token", ""))) * 2
        total += sum(56 + len(str(t.get("token", ""))) * 2 for t in top)  # type: ignore[union-attr]
    return total


def approx_size(raw: dict[str, object]) -> int:
    """An upper estimate of a wire item's serialized size in bytes (no serialization)."""
    size = 96 + 4 * len(str(raw.get("text") or raw.get("message") or ""))
    if raw.get("type") != "delta":
        return size
    size += 12 * len(raw.get("token_ids") or [])  # type: ignore[arg-type]
    size += _logprob_bytes(raw.get("logprobs"))  # type: ignore[arg-type]
    size += _logprob_bytes(raw.get("prompt_logprobs"))  # type: ignore[arg-type]
    for entry in raw.get("attribution") or []:  # type: ignore[union-attr]
        size += 32 + sum(24 + len(name) for name in entry.get("adapters", {}))
    summary = raw.get("gate_summary")
    if summary:  # experts x (layers + 2) numbers and the names
        experts = summary["experts"]  # type: ignore[index]
        size += 256 + sum(24 + 2 * len(e) for e in experts)
        size += 24 * len(experts) * (3 + len(summary.get("layer_top1_share") or []))  # type: ignore[union-attr]
    return size


def encode(item: InfoItem | DeltaItem | UsageItem | ErrorItem) -> dict[str, object]:
    """The wire form of an item (what crosses the deployment handle)."""
    return item.model_dump(exclude_defaults=False)


def decode(raw: object) -> InfoItem | DeltaItem | UsageItem | ErrorItem:
    """Parse one wire item; a malformed item is a replica bug and raises ValidationError."""
    return _ITEM.validate_python(raw)
