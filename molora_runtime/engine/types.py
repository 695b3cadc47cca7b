"""Request and output types of the engine's public API (offline `LLM` and `AsyncEngine`)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from molora_runtime.engine.speculation.spec_counters import SpecCounters
from molora_runtime.engine.structured.response_format import ResponseFormat
from molora_runtime.routes import BaseRoute, RouteSpec

FinishReason = Literal["stop", "length", "abort", "error"]
MAX_INT32 = 2**31 - 1
MAX_SEED = 2**64 - 1

# the engine's and the API's cache salt (the API passes it through unchanged)
CacheSalt = Annotated[
    str | None,
    Field(
        min_length=1,
        max_length=1024,
        description="vLLM's prefix-cache salt: cached prompt blocks are shared only between "
        "requests of one tenant with the same salt",
    ),
]
# the engine's and the API's switch for per-layer detail in a gate summary
GateSummaryLayers = Annotated[
    bool, Field(description="with the gate summary: each layer's top-1 expert shares too")
]

# `chat_template_kwargs`: scalars only, and none of the names the renderer itself passes
ChatTemplateValue = (
    bool
    | int
    | Annotated[float, Field(allow_inf_nan=False)]
    | Annotated[str, Field(max_length=1024)]
)
CHAT_TEMPLATE_RESERVED = frozenset(
    {
        "messages", "conversation", "tools", "documents", "chat_template", "tokenize",
        "add_generation_prompt", "continue_final_message", "return_dict", "tokenizer",
        "return_assistant_tokens_mask", "padding", "truncation", "max_length", "return_tensors",
        "tokenizer_kwargs",
    }
)  # fmt: skip


def check_chat_template_kwargs(kwargs: dict[str, object] | None) -> dict[str, object] | None:
    """Keys are short identifiers the renderer does not set itself (a ValueError otherwise)."""
    for key in kwargs or {}:
        if not key.isidentifier() or len(key) > 64 or key.startswith("_"):
            raise ValueError(f"chat_template_kwargs key {key[:64]!r} is not a plain identifier")
        if key in CHAT_TEMPLATE_RESERVED:
            raise ValueError(f"chat_template_kwargs may not set {key!r}")
    return kwargs


class SamplingParams(BaseModel):
    """Decoding controls; the names follow vLLM/OpenAI so users need no translation."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(64, ge=1, le=MAX_INT32)
    temperature: float = Field(
        0.0, ge=0.0, le=10.0, description="0 = greedy; below 1e-5 is greedy too"
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=MAX_INT32, description="0 = off")
    min_p: float = Field(
        0.0, ge=0.0, le=1.0, description="drop tokens below min_p x the top token's probability"
    )
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="a 64-bit unsigned seed")
    stop: list[str] = Field(default_factory=list)
    include_stop_str_in_output: bool = Field(
        False, description="keep the matched stop string (or stop token's text) in the output"
    )
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_INT32)]] = Field(
        default_factory=list, max_length=64, description="ids inside the vocabulary"
    )
    ignore_eos: bool = False
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="subtracted once from every token already generated"
    )
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="subtracted per occurrence in the generated tokens"
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        le=10.0,
        description="divides positive (multiplies negative) logits of prompt and output tokens",
    )
    logit_bias: dict[Annotated[int, Field(ge=0, le=MAX_INT32)], float] = Field(
        default_factory=dict, max_length=1024, description="token id -> bias in [-100, 100]"
    )
    min_tokens: int = Field(
        0, ge=0, le=MAX_INT32, description="EOS and stop_token_ids are masked until this many"
    )
    logprobs: int | None = Field(
        None, ge=0, le=20, description="report the sampled token's logprob and this many top ones"
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description="logprob of every prompt token (raw model logits) and this many top ones",
    )
    clamp_to_context: bool = Field(
        True,
        description="cut max_tokens to what the context leaves; False refuses the request instead",
    )

    @model_validator(mode="after")
    def _finite(self) -> SamplingParams:
        for name in ("temperature", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite")
        if any(not math.isfinite(b) or abs(b) > 100.0 for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be finite and within [-100, 100]")
        return self

    def needs_processing(self) -> bool:
        """Whether sampling must look beyond the raw logits (the common case stays fast)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.logprobs is not None
        )


class GenerationRequest(BaseModel):
    """One request for the engine: a prompt (text, token ids or chat messages) and its route."""

    model_config = ConfigDict(extra="forbid")

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = Field(
        None,
        description="chat messages (OpenAI's shape, tool calls and results included), rendered "
        "with the model's chat template",
    )
    tools: list[dict[str, Any]] | None = Field(
        None, max_length=128, description="tool definitions the chat template shows the model"
    )
    needs_tool_format: bool = Field(
        False,
        description="the model may choose to call a tool, or earlier calls are in the messages: "
        "the chat template must render tools (a 400 otherwise)",
    )
    route: RouteSpec = Field(default_factory=BaseRoute)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    return_attribution: bool = Field(False, description="report the adapters behind each token")
    return_gate_summary: bool = Field(
        False,
        description="a learned route's gate summary over the generated tokens, on the last "
        "output (a learned route only: InvalidRequestError otherwise)",
    )
    gate_summary_layers: GateSummaryLayers = False
    response_format: ResponseFormat | None = Field(
        None, description="constrain the output to JSON (optionally matching a JSON Schema)"
    )
    prefill_from: str | None = Field(
        None,
        description="id of a sibling request with the same prompt and route (n > 1): when both "
        "are admitted together, the prompt is prefilled once and its KV row copied",
    )
    images: list[list[Annotated[int, Field(ge=0, le=16)]]] | None = Field(
        None,
        max_length=16,
        description="8x8 images (64 grey levels, 0..16) for the U+FFFC slots of `messages` "
        "(molora_runtime/multimodal/prompt.py)",
    )
    image_output: bool = Field(
        False, description="generated image codes are images: kept out of the text"
    )
    tenant: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="who sent it: part of every KV block's cache key and of the fair share",
    )
    chat_template_kwargs: dict[str, ChatTemplateValue] | None = Field(
        None, max_length=16, description="extra variables for the chat template (enable_thinking)"
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, object] | None) -> dict[str, object] | None:
        return check_chat_template_kwargs(value)

    cache_salt: CacheSalt = None

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerationRequest:
        given = [x is not None for x in (self.prompt, self.prompt_token_ids, self.messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, prompt_token_ids or messages")
        if self.images is not None:
            if self.messages is None:
                raise ValueError("images go with messages (their U+FFFC slots)")
            if any(len(img) != 64 for img in self.images):
                raise ValueError("an image has 64 grey levels (8x8)")
        if self.gate_summary_layers and not self.return_gate_summary:
            raise ValueError("gate_summary_layers needs return_gate_summary")
        return self


@dataclass
class TokenLogprob:
    """The sampled token's logprob and the `top` most likely (token id, logprob) pairs."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class TokenAttribution:
    """Adapters that served one generated token and their mean weight over layers."""

    token_id: int
    adapters: dict[str, float]


@dataclass
class GateSummary:
    """How a learned route's gate routed one request's generated tokens (bounded: experts x
    layers numbers, never per token); `molora_runtime.engine.gate_summary` folds it."""

    composition: str  # the route's composition ref (pinned `name@version` when served)
    experts: list[str]  # the composition's adapters, in gate order
    tokens: int  # generated tokens routed
    layers: int
    share: list[float]  # per expert: its part of the (token, layer) top-k selections
    mean_weight: list[float]  # per expert: mean mixture weight over (token, layer), 0 unselected
    mean_entropy: float  # gate entropy over the experts / log(experts), mean over (token, layer)
    layer_top1_share: list[list[float]] | None = None  # [layer][expert] ranked first


@dataclass
class GenerationOutput:
    """One streamed increment of a request (the last one has `finished=True`)."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id matched (finished)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    attribution: list[TokenAttribution] | None = None
    logprobs: list[TokenLogprob] | None = None
    # Once, on the first output that carries tokens; the first prompt token has none (None).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_token_ids: list[int] | None = None  # with prompt_logprobs
    gate_summary: GateSummary | None = None  # on the finished output, when asked
    error: str | None = None
    exception: BaseException | None = field(default=None, repr=False, compare=False)


@dataclass
class StepOutputs:
    """Everything one engine step produced, for every request: the unit the engine hands on.

    One object per step (not one per request) so a consumer routes a whole step's increments
    in one pass; iterating it yields each request's `GenerationOutput`.
    """

    outputs: list[GenerationOutput] = field(default_factory=list)

    def __iter__(self) -> Iterator[GenerationOutput]:
        return iter(self.outputs)

    def __len__(self) -> int:
        return len(self.outputs)


@dataclass
class CompletionResult:
    """The whole result of one request in the offline API."""

    request_id: str
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: FinishReason | None
    attribution: list[TokenAttribution] | None = None
    logprobs: list[TokenLogprob] | None = None
    gate_summary: GateSummary | None = None  # with return_gate_summary (learned routes)


@dataclass
class BlockStats:
    """The paged KV cache: blocks in use and free, prefix-cache hits, preemptions."""

    block_size: int = 0
    blocks_total: int = 0
    blocks_used: int = 0
    blocks_free: int = 0  # includes cached blocks nobody holds (evictable)
    blocks_cached: int = 0  # blocks indexed by the prefix cache
    prefix_hit_tokens: int = 0
    prefix_queried_tokens: int = 0
    preemptions: int = 0


@dataclass
class EngineStats:
    """What a replica reports for placement and metrics."""

    running: int
    waiting: int
    hot_set: list[str]
    pinned: list[str]
    free_slots: int
    num_slots: int
    hot_set_hits: int = 0
    hot_set_misses: int = 0
    hot_set_evictions: int = 0
    hot_set_loads: int = 0
    compositions: list[str] = field(default_factory=list)
    # the host tier (parsed adapters in memory, fetched beside the step)
    host_resident: list[str] = field(default_factory=list)
    host_loading: list[str] = field(default_factory=list)
    host_bytes: int = 0
    host_fetches: int = 0
    host_fetch_failures: int = 0
    kv: BlockStats = field(default_factory=BlockStats)
    # rank pools: (rank, slots, free, evictable) each, none when padded; ranks of adapters held
    rank_pools: list[tuple[int, int, int, int]] = field(default_factory=list)
    adapter_ranks: dict[str, int] = field(default_factory=dict)
    speculation: SpecCounters | None = None  # draft acceptance, when speculative decoding is on


@dataclass
class RequestAdapters:
    """The adapters (and compositions) named by the requests running and waiting now, with how
    many requests name each: what vLLM's `lora_requests_info` gauge lists, read once per metrics
    period rather than kept up to date by the step (so the step pays nothing for it)."""

    running: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
