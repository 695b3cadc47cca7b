"""OpenAI-compatible request payloads.

Requests forbid unknown keys so a misspelt parameter is a 400 naming it rather than a silently
ignored setting; parameters OpenAI defines but we do not implement are accepted only at their
neutral value. Request models are strict: JSON types are not coerced ("5" is not an integer,
"yes" not a boolean). Every number has a bound (the README's *Request bounds*). The `molora`
object is our extension: an explicit route, per-token attribution, gate summaries, opt-in
truncation.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from deployments.api.message_models import ChatMessage
from deployments.api.payload import Payload
from deployments.api.tool_models import ToolFields
from molora_runtime.engine.types import (
    MAX_INT32,
    MAX_SEED,
    CacheSalt,
    ChatTemplateValue,
    GateSummaryLayers,
    check_chat_template_kwargs,
)
from molora_runtime.multimodal.prompt import IMAGE_SLOT
from molora_runtime.routes import RouteSpec

MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 1024
MAX_N = 16  # choices per request (n, best_of)
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_TOP_LOGPROBS = 20
MAX_IMAGES = 16  # image parts per request

# Parameters OpenAI defines that this server does not implement (dotted paths, list indexes left
# out): a 400 says so and why, rather than reading like the caller's typo.
OPENAI_UNSUPPORTED: dict[str, str] = {
    "functions": "the deprecated functions API is not supported; send tools",
    "function_call": "the deprecated functions API is not supported; send tool_choice",
    "audio": "audio output is not supported",
    "modalities": "output modalities other than text are not supported",
    "prediction": "predicted outputs are not supported",
    "store": "stored completions are not supported",
    "metadata": "stored completions (and their metadata) are not supported",
    "service_tier": "service tiers are not supported",
    "reasoning_effort": "reasoning effort is not supported",
    "verbosity": "verbosity is not supported",
    "web_search_options": "web search is not supported",
    "prompt_cache_key": "prompt cache keys are not supported; see cache_salt",
    "safety_identifier": "safety identifiers are not supported; see user",
    "stream_options.include_obfuscation": "stream obfuscation is not supported",
    "messages.refusal": "assistant refusals in history are not supported",
    "messages.audio": "audio in history is not supported",
    "messages.function_call": "the deprecated functions API is not supported; send tool_calls",
}

# Values of those parameters that ask for nothing (what a client sends as its default): accepted.
OPENAI_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "prediction": (None,),
}


class MoloraOptions(Payload):
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
    gate_summary: bool = Field(
        False,
        description="a learned composition's gate over each choice's generated tokens (expert "
        "shares, mean weights, mean entropy) in `molora.gate_summary`; a 400 on other routes",
    )
    gate_summary_layers: GateSummaryLayers = False

    @model_validator(mode="after")
    def _layers_need_summary(self) -> MoloraOptions:
        if self.gate_summary_layers and not self.gate_summary:
            raise ValueError("gate_summary_layers needs gate_summary: true")
        return self


class JsonSchemaSpec(Payload):
    """OpenAI's `response_format.json_schema`: a named JSON Schema."""

    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = Field(None, max_length=4096)
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON Schema to follow")
    strict: bool | None = Field(None, description="accepted; the schema is always enforced")


class ResponseFormatText(Payload):
    type: Literal["text"]


class ResponseFormatJsonObject(Payload):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(Payload):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormatBody = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
    Field(discriminator="type"),
]


class StreamOptions(Payload):
    include_usage: bool = False


class _SamplingFields(Payload):
    @model_validator(mode="before")
    @classmethod
    def _drop_neutral(cls, data: Any) -> Any:
        """OpenAI parameters we do not implement, sent at the value that asks for nothing."""
        if isinstance(data, dict) and any(
            k in OPENAI_NEUTRAL and data[k] in OPENAI_NEUTRAL[k] for k in data
        ):
            return {
                k: v
                for k, v in data.items()
                if k not in OPENAI_NEUTRAL or v not in OPENAI_NEUTRAL[k]
            }
        return data

    model: str = Field(min_length=1, max_length=4096)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, le=MAX_INT32, description="vLLM extension; 0 or -1 = off")
    min_p: float = Field(
        0.0, ge=0.0, le=1.0, allow_inf_nan=False, description="vLLM extension; 0 = off"
    )
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="0 .. 2**64-1")
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_INT32)]] = Field(
        default_factory=list, max_length=MAX_STOP_TOKEN_IDS, description="ids in the vocabulary"
    )
    ignore_eos: bool = False
    include_stop_str_in_output: bool = Field(
        False, description="vLLM extension: keep the matched stop string in the text"
    )
    cache_salt: CacheSalt = None
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

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, value: int) -> int:
        """vLLM's clients (`vllm bench serve`) send -1 for "off"; the engine spells it 0."""
        return 0 if value == -1 else value

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

    def choice_counts(self) -> tuple[int, int]:
        """(choices returned, choices generated): n, and for completions best_of."""
        return self.n, self.n


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

    def choice_counts(self) -> tuple[int, int]:
        return self.n, self.best_of or self.n

    def prompt_text(self) -> str | None:
        """The prompt as text for echo (None for token ids: the replica's token texts)."""
        if isinstance(self.prompt, str):
            return self.prompt
        if isinstance(self.prompt[0], str):
            return str(self.prompt[0])
        return None


class ChatCompletionRequest(_SamplingFields, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[str, ChatTemplateValue] | None = Field(
        None,
        max_length=16,
        description="vLLM extension: extra chat-template variables (e.g. enable_thinking); "
        "scalars only, not the renderer's own names",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_chat_template_kwargs(value)

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if sum(m.image_count() for m in self.messages) > MAX_IMAGES:
            raise ValueError(f"at most {MAX_IMAGES} image parts per request")
        if self.has_images() and any(IMAGE_SLOT in t for m in self.messages for t in m.texts()):
            raise ValueError("U+FFFC marks image parts: a request with images cannot use it")
        if self.response_format is not None and self.tool_mode() in ("required", "named"):
            raise ValueError(
                "response_format cannot be combined with tool_choice 'required' or a named "
                "function: both decide the whole output"
            )
        return self

    def has_images(self) -> bool:
        return any(m.image_count() for m in self.messages)

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def engine_messages(self) -> list[dict[str, Any]]:
        return [m.engine_message() for m in self.messages]

    def has_tool_history(self) -> bool:
        return any(m.tool_calls or m.role == "tool" for m in self.messages)

    def engine_format(self) -> dict[str, Any] | None:
        """A forced tool call's grammar, else the response format's."""
        return self.tool_call_format() or super().engine_format()
