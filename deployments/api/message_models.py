"""The messages of a chat request: text and image content parts, tool calls and tool answers."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from deployments.api.payload import Payload
from deployments.api.tool_models import ToolCallsIn
from molora_runtime.multimodal.prompt import IMAGE_SLOT


class ContentPart(Payload):
    type: Literal["text"]
    text: str


class ImageURL(Payload):
    url: str = Field(
        description="data:image/png;base64,... only (remote URLs are refused, never fetched); "
        "a PNG of at most 256 KiB, each side 8..128 pixels"
    )
    detail: Literal["auto", "low", "high"] | None = Field(None, description="accepted, unused")


class ImageContentPart(Payload):
    """An image in a message: read as an 8x8 digit with 17 grey levels (the image codes)."""

    type: Literal["image_url"]
    image_url: ImageURL


MessagePart = Annotated[ContentPart | ImageContentPart, Field(discriminator="type")]


class ChatMessage(Payload):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[MessagePart] | None = Field(
        None, description="null only for an assistant message that makes tool calls"
    )
    name: str | None = Field(None, description="not supported: refused rather than dropped")
    tool_calls: ToolCallsIn | None = Field(None, description="an assistant message's calls")
    tool_call_id: str | None = Field(
        None, min_length=1, max_length=256, description="the call a tool message answers"
    )

    @model_validator(mode="after")
    def _tool_shape(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.tool_call_id is None) != (self.role != "tool"):
            raise ValueError("tool messages, and only they, carry a tool_call_id")
        if self.content is None and self.tool_calls is None:
            raise ValueError("content is required (null only with tool_calls)")
        return self

    @field_validator("name")
    @classmethod
    def _no_name(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError(
                "message names are not supported (the chat template has no place for them)"
            )
        return value

    def text(self) -> str:
        """The message's text; each image part becomes an IMAGE_SLOT the engine fills."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(
            part.text if isinstance(part, ContentPart) else IMAGE_SLOT for part in self.content
        )

    def texts(self) -> list[str]:
        if self.content is None:
            return []
        if isinstance(self.content, str):
            return [self.content]
        return [p.text for p in self.content if isinstance(p, ContentPart)]

    def image_count(self) -> int:
        if not isinstance(self.content, list):
            return 0
        return sum(isinstance(p, ImageContentPart) for p in self.content)

    def engine_message(self) -> dict[str, Any]:
        """The message as the chat template gets it (developer is system)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        out["content"] = self.text()
        if self.tool_calls is not None:
            out["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out
