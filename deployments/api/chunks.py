"""Streamed OpenAI chunks as plain dicts, laid out exactly as the protocol's models dump them.

The models in `response_models` stay the definition of every chunk; `typed_chunk` and
`typed_usage_chunk` build the same chunk through them (the reference twin, compared byte for byte
in the tests), while the streaming path builds dicts directly: no model per token. The layout
the models give and these functions repeat: envelope fields in `_Envelope`'s order (id,
created, model, usage, molora, then object and choices), absent fields left out (the dump's
`exclude_none`), and `stop_reason` written, null too, on every finished choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deployments.api.response_models import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionChunk,
    DeltaMessage,
    ImageOut,
    MoloraInfo,
    ToolCallDelta,
    Usage,
)


@dataclass(slots=True)
class ChunkFields:
    """What one streamed choice chunk says; `molora` is a `MoloraInfo` dump, `images` are
    `ImageOut` dumps, `tool_calls` are `ToolCallDelta` dumps."""

    id: str
    created: int
    model: str
    chat: bool
    index: int
    text: str | None
    role: bool = False
    images: list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: dict[str, Any] | None = None
    molora: dict[str, Any] | None = None


def molora_info(
    route_kind: str,
    versions: list[str] | None,
    replica: str | None,
    hot_set_hit: bool | None,
    tier: str | None,
    attribution: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    """`MoloraInfo`'s dump; `attribution` entries are wire dicts (token_id, adapters)."""
    info: dict[str, Any] = {"route_kind": route_kind}
    if versions is not None:
        info["versions"] = versions
    if replica is not None:
        info["replica"] = replica
    if hot_set_hit is not None:
        info["hot_set_hit"] = hot_set_hit
    if tier is not None:
        info["tier"] = tier
    if attribution is not None:
        info["attribution"] = [
            {"token_id": a["token_id"], "adapters": a["adapters"]} for a in attribution
        ]
    return info


def _choice(f: ChunkFields) -> dict[str, Any]:
    choice: dict[str, Any] = {}
    if f.finish_reason is not None:
        choice["finish_reason"] = f.finish_reason
    if f.stop_reason is not None:
        choice["stop_reason"] = f.stop_reason
    choice["index"] = f.index
    if f.chat:
        delta: dict[str, Any] = {"role": "assistant"} if f.role else {}
        if f.text is not None:
            delta["content"] = f.text
        if f.images:
            delta["images"] = f.images
        if f.tool_calls:
            delta["tool_calls"] = f.tool_calls
        choice["delta"] = delta
    else:
        choice["text"] = f.text
    if f.logprobs is not None:
        choice["logprobs"] = f.logprobs
    if f.finish_reason is not None and f.stop_reason is None:
        choice["stop_reason"] = None
    return choice


def chunk(f: ChunkFields) -> dict[str, Any]:
    """The chunk of one choice's increment, as `typed_chunk` dumps it."""
    out: dict[str, Any] = {"id": f.id, "created": f.created, "model": f.model}
    if f.molora is not None:
        out["molora"] = f.molora
    out["object"] = "chat.completion.chunk" if f.chat else "text_completion"
    out["choices"] = [_choice(f)]
    return out


def usage_chunk(
    id: str, created: int, model: str, chat: bool, prompt: int, completion: int
) -> dict[str, Any]:
    """The last chunk of `stream_options.include_usage`: no choices, the usage."""
    usage = {"prompt_tokens": prompt, "completion_tokens": completion}
    usage["total_tokens"] = prompt + completion
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": id, "created": created, "model": model, "usage": usage, "object": kind,
            "choices": []}  # fmt: skip


# -- the reference twins: the same chunks through the protocol's models ----------------------


def typed_chunk(f: ChunkFields) -> dict[str, Any]:
    molora = MoloraInfo.model_validate(f.molora) if f.molora is not None else None
    if f.chat:
        delta = DeltaMessage(
            content=f.text,
            images=[ImageOut.model_validate(i) for i in f.images] if f.images else None,
            tool_calls=[ToolCallDelta.model_validate(c) for c in f.tool_calls]
            if f.tool_calls
            else None,
        )
        if f.role:
            delta.role = "assistant"
        choice: Any = ChatChunkChoice(
            index=f.index, delta=delta, finish_reason=f.finish_reason,
            stop_reason=f.stop_reason, logprobs=f.logprobs,
        )  # fmt: skip
        model: Any = ChatCompletionChunk(
            id=f.id, created=f.created, model=f.model, choices=[choice], molora=molora
        )
    else:
        choice = CompletionChoice(
            index=f.index, text=f.text, finish_reason=f.finish_reason,
            stop_reason=f.stop_reason, logprobs=f.logprobs,
        )  # fmt: skip
        model = CompletionChunk(
            id=f.id, created=f.created, model=f.model, choices=[choice], molora=molora
        )
    return model.model_dump(exclude_none=True)


def typed_usage_chunk(
    id: str, created: int, model: str, chat: bool, prompt: int, completion: int
) -> dict[str, Any]:
    usage = Usage(prompt_tokens=prompt, completion_tokens=completion,
                  total_tokens=prompt + completion)  # fmt: skip
    cls: Any = ChatCompletionChunk if chat else CompletionChunk
    return cls(id=id, created=created, model=model, choices=[], usage=usage).model_dump(
        exclude_none=True
    )
