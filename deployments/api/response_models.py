"""OpenAI-compatible response payloads and response ids (the error shape: protocol/openai_error)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class TokenAttributionOut(BaseModel):
    token_id: int
    adapters: dict[str, float]


class ExpertShareOut(BaseModel):
    adapter: str = Field(description="the expert adapter, as name@version")
    share: float = Field(description="its part of the (token, layer) top-k selections")
    mean_weight: float = Field(
        description="its mixture weight, averaged over every (token, layer), 0 where unselected"
    )


class GateSummaryOut(BaseModel):
    """How a learned composition's gate routed one choice's generated tokens."""

    index: int = Field(description="the choice")
    composition: str
    version: str | None = None
    tokens: int = Field(description="generated tokens routed (prompt tokens are not counted)")
    layers: int
    experts: list[ExpertShareOut]
    mean_entropy: float = Field(
        description="gate entropy / log(experts), averaged over (token, layer): 0 one-hot, 1 flat"
    )
    layer_top1_share: list[list[float]] | None = Field(
        None, description="[layer][expert]: tokens that ranked the expert first (gate order)"
    )


class MoloraInfo(BaseModel):
    """What we add to responses: where the request ran and, on request, per-token attribution."""

    route_kind: str
    versions: list[str] | None = None  # the exact name@version refs that served the request
    replica: str | None = None
    hot_set_hit: bool | None = None
    tier: str | None = None  # where the adapters were on arrival: slot|host|loading|disk|store
    attribution: list[TokenAttributionOut] | None = None
    gate_summary: list[GateSummaryOut] | None = None  # per choice, when asked (learned routes)


class _Choice(BaseModel):
    """What every choice carries before its content: vLLM's `stop_reason` beside
    `finish_reason` (the stop string or stop token id that ended the choice, null at EOS or
    length; written, null too, on every finished choice) and its index."""

    finish_reason: str | None = None
    stop_reason: str | int | None = None
    index: int = 0

    @model_serializer(mode="wrap")
    def _stop_reason(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if self.finish_reason is not None:
            data["stop_reason"] = self.stop_reason
        return data


ChoiceT = TypeVar("ChoiceT", bound=_Choice)


class _Envelope(BaseModel, Generic[ChoiceT]):
    """Every completion response and chunk: the same fields around its choices; each kind
    narrows `object` to its literal and names its choice type (`_Envelope[ChatChoice]`)."""

    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: Usage | None = None
    molora: MoloraInfo | None = None
    object: str
    choices: list[ChoiceT]


class CompletionChoice(_Choice):
    text: str
    logprobs: dict[str, Any] | None = None


class CompletionResponse(_Envelope[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"


class ImageURLOut(BaseModel):
    url: str = Field(description="data:image/png;base64,... (64x64 grey, each pixel 8x8)")


class ImageOut(BaseModel):
    """A generated image (OpenRouter's `message.images` entry): a PNG data URL."""

    type: Literal["image_url"] = "image_url"
    image_url: ImageURLOut


class FunctionCallOut(BaseModel):
    name: str
    arguments: str = Field(description="JSON text of the arguments")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    images: list[ImageOut] | None = Field(
        None, description="generated images, in order (with `molora.images`, else absent)"
    )
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _null_content(self, handler: Any) -> dict[str, Any]:
        """`content` stays in the JSON as null beside tool calls, as OpenAI writes it."""
        out = handler(self)
        out.setdefault("content", self.content)
        return out


class ChatChoice(_Choice):
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None


class ChatCompletionResponse(_Envelope[ChatChoice]):
    object: Literal["chat.completion"] = "chat.completion"


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str


class ToolCallDelta(BaseModel):
    """A call's first delta carries id, type and name; later ones more arguments text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    images: list[ImageOut] | None = Field(None, description="images closed in this chunk")
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Choice):
    delta: DeltaMessage
    logprobs: dict[str, Any] | None = None


class ChatCompletionChunk(_Envelope[ChatChunkChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class CompletionChunk(_Envelope[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "molora"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = Field(None, description="prompt + completion tokens (vLLM's)")
    molora: dict[str, Any] = Field(default_factory=dict, description="kind, versions, experts")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
