"""The one place replica items become OpenAI responses and chunks.

Text, logprobs (with echo), generated images, usage, n > 1 (choices by their `index`, best_of
ranking) and adapter attribution are shaped here, for both chat and text completions. Deltas are
read as wire dicts (`deployments.protocol.wire`'s `delta` shape) and streamed chunks are built as
plain dicts (`chunks`), the protocol's models only for whole responses.
"""

from __future__ import annotations

import json
import time
from typing import Any

from deployments.api.chunks import ChunkFields, chunk, molora_info, usage_chunk
from deployments.api.gate_summary import choice_summaries, gate_summary_out
from deployments.api.images import ImageOutput
from deployments.api.logprobs import chat_logprobs, completion_logprobs, mean_logprob
from deployments.api.response_models import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    Usage,
)
from deployments.api.response_shape import ResponseShape
from deployments.api.tool_calls import ToolCallShaping
from deployments.protocol.wire import DeltaItem, InfoItem, ReplicaItem, UsageItem, encode

Item = ReplicaItem
Wire = dict[str, Any]  # a wire `delta` (deployments.protocol.wire)


def sse(payload: Any) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def head_info(head: list[Item]) -> InfoItem | None:
    """The `info` a started stream opened with (absent when it failed before any output)."""
    return head[0] if isinstance(head[0], InfoItem) else None


class Shaper:
    """Turns replica items into OpenAI responses and chunks (choices by their `index`)."""

    # how a streamed chunk is laid out: `chunks.chunk`; the tests swap in its typed twin
    render = staticmethod(chunk)
    render_usage = staticmethod(usage_chunk)

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.chat, self.id, self.model = shape.chat, shape.request_id, shape.model
        self.show_replica = shape.show_replica  # which replica served, hot-set hit, tier
        self.images = ImageOutput() if shape.images else None
        self.created = int(time.time())  # one `created` for every chunk of the stream
        self.include_usage = shape.include_usage
        self.prompt_tokens = self.completion_tokens = 0
        self.sent_role: set[int] = set()
        self.info: InfoItem | None = None
        self.want_logprobs = shape.want_logprobs
        self.attribution = shape.attribution
        self.n, self.best_of = shape.n, shape.best_of
        self.offsets: dict[int, int] = {}  # completions' text_offset per choice (streaming)
        self.echo = shape.echo
        self.tools = ToolCallShaping.for_shape(shape)  # tool calls read out of the text
        # Text-only deltas (no images, logprobs, attribution or tool calls asked) after a
        # choice's first chunk are written straight to SSE text from the wire dict.
        self.plain = self.images is None and not self.want_logprobs and self.tools is None
        self.plain = self.plain and not self.attribution
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        self._head = (
            f'data: {{"id":{json.dumps(self.id)},"created":{self.created},'
            f'"model":{json.dumps(self.model)},"object":"{kind}","choices":[{{"index":'
        )
        self._text_key = ',"delta":{"content":' if self.chat else ',"text":'

    def _echo(self, deltas: list[Wire]) -> tuple[str, list[Wire]]:
        """Echo's prompt text and its logprob items (from the choice's first delta)."""
        items = next(
            (d["prompt_logprobs"] for d in deltas if d.get("prompt_logprobs") is not None), []
        )
        text = self.shape.echo_text
        if text is None:
            text = "".join(i["token"] for i in items)
        return text, items

    def _logprobs(
        self, deltas: list[Wire], offset: int = 0, prompt: list[Wire] | None = None
    ) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        items = [lp for d in deltas for lp in d.get("logprobs") or []]
        if self.chat:
            return chat_logprobs(items)
        return completion_logprobs([*(prompt or []), *items], offset)

    def _usage(self, item: UsageItem) -> None:
        self.prompt_tokens, self.completion_tokens = item.prompt_tokens, item.completion_tokens

    def _info(self, with_replica: bool, attribution: list[Wire] | None) -> dict[str, Any]:
        """`MoloraInfo`'s dump: the route and, first, where it ran; attribution when asked."""
        info = self.info if with_replica and self.show_replica else None
        return molora_info(
            self.shape.route_kind,
            list(self.shape.versions) or None,
            info.replica if info else None,
            info.hot_set_hit if info else None,
            info.tier if info else None,
            attribution,
        )

    def full(self, items: list[Item | Wire]) -> dict[str, Any]:
        """The whole (non-streaming) response, through the protocol's models."""
        by_index: dict[int, list[Wire]] = {}
        for item in items:
            if isinstance(item, InfoItem):
                self.info = item
            elif isinstance(item, UsageItem):
                self._usage(item)
            elif isinstance(item, DeltaItem | dict):
                raw = encode(item) if isinstance(item, DeltaItem) else item
                by_index.setdefault(raw["index"], []).append(raw)
        order = sorted(by_index)
        if self.best_of > self.n:  # best_of: the n choices with the best mean token logprob
            score = {
                i: mean_logprob([lp for d in by_index[i] for lp in d.get("logprobs") or []])
                for i in order
            }
            order = sorted(order, key=lambda i: -score[i])[: self.n]
        chat_choices: list[ChatChoice] = []
        text_choices: list[CompletionChoice] = []
        attribution = None
        for out_index, i in enumerate(order):
            deltas = by_index[i]
            text = "".join(d["text"] for d in deltas)
            last = next((d for d in reversed(deltas) if d["finish_reason"]), None)
            finish = last["finish_reason"] if last else None
            stop_reason = last.get("stop_reason") if last else None
            if self.attribution and out_index == 0:
                attribution = [a for d in deltas for a in d.get("attribution") or []]
            prompt: list[Wire] = []
            if self.echo:
                prompt_text, prompt = self._echo(deltas)
                text = prompt_text + text
            logprobs = self._logprobs(deltas, 0, prompt)
            if self.chat:
                message = AssistantMessage(content=text)
                if self.tools is not None:
                    content, calls, finish = self.tools.message(text, finish)
                    message = AssistantMessage(content=content, tool_calls=calls)
                if self.images is not None:
                    message.images = ImageOutput.all([t for d in deltas for t in d["token_ids"]])
                chat_choices.append(
                    ChatChoice(
                        index=out_index,
                        message=message,
                        finish_reason=finish,
                        stop_reason=stop_reason,
                        logprobs=logprobs,
                    )
                )
            else:
                text_choices.append(
                    CompletionChoice(
                        index=out_index,
                        text=text,
                        finish_reason=finish,
                        stop_reason=stop_reason,
                        logprobs=logprobs,
                    )
                )
        info = self._info(True, attribution)
        summaries = choice_summaries(by_index, order)
        if summaries is not None:
            info["gate_summary"] = summaries
        p, c = self.prompt_tokens, self.completion_tokens
        usage = Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)
        if self.chat:
            return ChatCompletionResponse(
                id=self.id, model=self.model, choices=chat_choices, usage=usage, molora=info
            ).model_dump(exclude_none=True)
        return CompletionResponse(
            id=self.id, model=self.model, choices=text_choices, usage=usage, molora=info
        ).model_dump(exclude_none=True)

    def sse(self, item: Item | Wire) -> str:
        """The SSE text of one item: a wire delta (as the stream carries them past the head),
        or a typed item of the head."""
        if isinstance(item, dict):
            raw = item
        elif isinstance(item, DeltaItem):
            raw = encode(item)
        else:
            if isinstance(item, InfoItem):
                self.info = item
            elif isinstance(item, UsageItem):
                self._usage(item)
            return ""
        if self.plain and raw["finish_reason"] is None and raw["index"] in self.sent_role:
            return self._plain_delta(raw)
        out = self.delta_chunk(raw)
        return "" if out is None else sse(out)

    def _plain_delta(self, raw: Wire) -> str:
        """`delta_chunk`'s output for a text-only, unfinished delta of a choice already
        started, as SSE text (a choice's last chunk, with its finish and stop reasons, takes
        `delta_chunk`)."""
        text = raw["text"]
        if not text:
            return ""
        close = "}" if self.chat else ""
        return f"{self._head}{raw['index']}{self._text_key}{json.dumps(text)}{close}}}]}}\n\n"

    def delta_chunk(self, raw: Wire) -> dict[str, Any] | None:
        """The chunk of one wire delta (None when it says nothing)."""
        text, finish, index = raw["text"], raw["finish_reason"], raw["index"]
        token_logprobs, attribution = raw.get("logprobs"), raw.get("attribution")
        calls = None
        if self.tools is not None:
            text, calls, finish = self.tools.delta(index, text, finish)
        first = index not in self.sent_role
        images = []
        if self.images is not None:
            images = self.images.feed(index, raw["token_ids"], finish is not None)
        if not (text or calls or first or token_logprobs or images) and finish is None:
            return None
        info = None
        if (first and not self.sent_role) or attribution:
            info = self._info(not self.sent_role, attribution)
        if raw.get("gate_summary") is not None:  # on the choice's finishing chunk
            info = info or self._info(False, None)
            info["gate_summary"] = [gate_summary_out(index, raw["gate_summary"])]
        offset = self.offsets.get(index, 0)
        prompt: list[Wire] = []
        if self.echo and first:
            prompt_text, prompt = self._echo([raw])
            text = prompt_text + text
        logprobs = None
        if token_logprobs or finish or prompt:
            logprobs = self._logprobs([raw], offset, prompt)
        if logprobs is not None and not self.chat:
            self.offsets[index] = offset + sum(
                len(lp["token"]) for lp in [*prompt, *(token_logprobs or [])]
            )
        self.sent_role.add(index)
        return self.render(
            ChunkFields(
                id=self.id, created=self.created, model=self.model, chat=self.chat,
                index=index, text=text, role=first and self.chat,
                images=[i.model_dump() for i in images] or None, tool_calls=calls,
                finish_reason=finish, stop_reason=raw.get("stop_reason"),
                logprobs=logprobs, molora=info,
            )
        )  # fmt: skip

    def usage_chunk(self) -> dict[str, Any]:
        return self.render_usage(
            self.id, self.created, self.model, self.chat, self.prompt_tokens,
            self.completion_tokens,
        )  # fmt: skip
