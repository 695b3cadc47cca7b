"""OpenAI-compatible response payloads, the error shape and response ids."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class TokenAttributionOut(BaseModel):
    token_id: int
    adapters: dict[str, float]


class MoloraInfo(BaseModel):
    """What we add to responses: where the request ran and, on request, per-token attribution."""

    route_kind: str
    versions: list[str] | None = None  # the exact name@version refs that served the request
    replica: str | None = None
    hot_set_hit: bool | None = None
    tier: str | None = None  # where the adapters were on arrival: slot|host|loading|disk|store
    attribution: list[TokenAttributionOut] | None = None


class _Envelope(BaseModel):
    """The fields every completion response and chunk carries besides its object and choices."""

    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: Usage | None = None
    molora: MoloraInfo | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class CompletionResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ImageURLOut(BaseModel):
    url: str = Field(description="data:image/png;base64,... (64x64 grey, each pixel 8x8)")


class ImageOut(BaseModel):
    """A generated image (OpenRouter's `message.images` entry): a PNG data URL."""

    type: Literal["image_url"] = "image_url"
    image_url: ImageURLOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    images: list[ImageOut] | None = Field(
        None, description="generated images, in order (with `molora.images`, else absent)"
    )


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    images: list[ImageOut] | None = Field(None, description="images closed in this chunk")


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionChunk(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "molora"
    root: str | None = None
    parent: str | None = None
    molora: dict[str, Any] = Field(default_factory=dict, description="kind, versions, experts")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error shape: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorBody


ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


def error_payload(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    body = ErrorBody(
        message=message, type=ERROR_TYPES.get(status, "error"), param=param, code=status
    )
    return ErrorResponse(error=body).model_dump()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
