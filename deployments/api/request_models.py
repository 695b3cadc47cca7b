"""OpenAI-compatible request payloads.

Requests forbid unknown keys so a misspelt parameter is a 400 naming it rather than a silently
ignored setting; parameters OpenAI defines but we do not implement are accepted only at their
neutral value. Request models are strict: JSON types are not coerced ("5" is not an integer,
"yes" not a boolean). Every number has a bound (the README's *Request bounds*). The `molora`
object is our extension: an explicit route, per-token attribution, opt-in truncation.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from molora_runtime.engine.types import MAX_INT32, MAX_SEED
from molora_runtime.multimodal.prompt import IMAGE_SLOT
from molora_runtime.routes import RouteSpec

MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 1024
MAX_N = 16  # choices per request (n, best_of)
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_TOP_LOGPROBS = 20
MAX_IMAGES = 16  # image parts per request


class _Payload(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class MoloraOptions(_Payload):
    """Our extension of the request body."""

    route: RouteSpec | None = Field(
        None, description="explicit route; overrides what `model` implies"
    )
    return_attribution: bool = Field(False, description="report the adapters behind each token")
    allow_truncation: bool = Field(
        False,
        description="when prompt + max_tokens exceed the context, cut max_tokens instead of "
        "answering 400",
    )
    images: bool | None = Field(
        None,
        description="return generated image codes as PNG image parts (`message.images`) and keep "
        "them out of the text; default: when the request has image parts or its route sends "
        "the image-code range to an adapter",
    )


class JsonSchemaSpec(_Payload):
    """OpenAI's `response_format.json_schema`: a named JSON Schema."""

    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = Field(None, max_length=4096)
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON Schema to follow")
    strict: bool | None = Field(None, description="accepted; the schema is always enforced")


class ResponseFormatText(_Payload):
    type: Literal["text"]


class ResponseFormatJsonObject(_Payload):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(_Payload):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormatBody = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
    Field(discriminator="type"),
]


class StreamOptions(_Payload):
    include_usage: bool = False


class _SamplingFields(_Payload):
    model: str = Field(min_length=1, max_length=4096)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=MAX_INT32, description="vLLM extension; 0 = off")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="0 .. 2**64-1")
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_INT32)]] = Field(
        default_factory=list, max_length=MAX_STOP_TOKEN_IDS, description="ids in the vocabulary"
    )
    ignore_eos: bool = False
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="vLLM's prefix-cache salt: cached prompt blocks are shared only between "
        "requests of one tenant with the same salt",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N, description="choices to generate (seeds seed, seed+1, ...)")
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, allow_inf_nan=False, description="minus p for every seen token"
    )
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, allow_inf_nan=False, description="minus p per occurrence"
    )
    repetition_penalty: float = Field(
        1.0, gt=0.0, le=10.0, allow_inf_nan=False, description="vLLM extension; 1 = off"
    )
    min_tokens: int = Field(
        0, ge=0, le=MAX_INT32, description="vLLM extension: no EOS/stop before this many tokens"
    )
    logit_bias: (
        dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] | None
    ) = Field(None, max_length=MAX_LOGIT_BIAS, description="token id (a string) -> bias")
    response_format: ResponseFormatBody | None = Field(
        None, description="JSON output: json_object, or json_schema (a grammar-masked decode)"
    )
    user: str | None = Field(None, max_length=256)
    molora: MoloraOptions = Field(default_factory=MoloraOptions)

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isascii() or not key.isdigit() or len(key) > 10 or int(key) > MAX_INT32:
                raise ValueError(f"logit_bias keys must be token ids, got {key[:20]!r}")
        return value

    def engine_format(self) -> dict[str, Any] | None:
        """The engine's `ResponseFormat` (as a dict), or None for plain text."""
        fmt = self.response_format
        if isinstance(fmt, ResponseFormatJsonObject):
            return {"type": "json_object"}
        if isinstance(fmt, ResponseFormatJsonSchema):
            return {"type": "json_schema", "json_schema": fmt.json_schema.schema_}
        return None

    def bias_ids(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 8 or any(not s for s in stops):
            raise ValueError("stop must be at most 8 non-empty strings")
        return value

    @model_validator(mode="after")
    def _no_stream_opts_without_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[Annotated[int, Field(ge=0, le=MAX_INT32)]] | list[str] = Field(
        description="text, token ids, or one text"
    )
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="top alternatives")
    suffix: str | None = None
    best_of: int | None = Field(
        None, ge=1, le=MAX_N, description="samples drawn; the n with the best mean logprob return"
    )

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt must not be empty")
            if isinstance(value[0], str):
                if len(value) != 1:
                    raise ValueError("batched prompts are not supported; send one per request")
            elif any(t < 0 for t in value):
                raise ValueError("prompt token ids must be >= 0")
        elif not value:
            raise ValueError("prompt must not be empty")
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError("best_of must be at least n")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of > n cannot be streamed")
        return self

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompt_text(self) -> str | None:
        """The prompt as text for echo (None for token ids: the replica's token texts)."""
        if isinstance(self.prompt, str):
            return self.prompt
        if isinstance(self.prompt[0], str):
            return str(self.prompt[0])
        return None


class ContentPart(_Payload):
    type: Literal["text"]
    text: str


class ImageURL(_Payload):
    url: str = Field(
        description="data:image/png;base64,... only (remote URLs are refused, never fetched); "
        "a PNG of at most 256 KiB, each side 8..128 pixels"
    )
    detail: Literal["auto", "low", "high"] | None = Field(None, description="accepted, unused")


class ImageContentPart(_Payload):
    """An image in a message: read as an 8x8 digit with 17 grey levels (the image codes)."""

    type: Literal["image_url"]
    image_url: ImageURL


MessagePart = Annotated[ContentPart | ImageContentPart, Field(discriminator="type")]


class ChatMessage(_Payload):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[MessagePart]
    name: str | None = Field(None, description="not supported: refused rather than dropped")

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
        if isinstance(self.content, str):
            return self.content
        return "".join(
            part.text if isinstance(part, ContentPart) else IMAGE_SLOT for part in self.content
        )

    def texts(self) -> list[str]:
        if isinstance(self.content, str):
            return [self.content]
        return [p.text for p in self.content if isinstance(p, ContentPart)]

    def image_count(self) -> int:
        if isinstance(self.content, str):
            return 0
        return sum(isinstance(p, ImageContentPart) for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if sum(m.image_count() for m in self.messages) > MAX_IMAGES:
            raise ValueError(f"at most {MAX_IMAGES} image parts per request")
        if self.has_images() and any(IMAGE_SLOT in t for m in self.messages for t in m.texts()):
            raise ValueError("U+FFFC marks image parts: a request with images cannot use it")
        return self

    def has_images(self) -> bool:
        return any(m.image_count() for m in self.messages)

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def engine_messages(self) -> list[dict[str, str]]:
        role = {"developer": "system"}
        return [{"role": role.get(m.role, m.role), "content": m.text()} for m in self.messages]
