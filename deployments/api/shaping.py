"""The one place replica items become OpenAI responses and chunks.

Text, logprobs (with echo), generated images, usage, n > 1 (choices by their `index`, best_of
ranking) and adapter attribution are shaped here, for both chat and text completions.
"""

from __future__ import annotations

import json
import time
from typing import Any

from deployments.api.gate_summary import choice_summaries, gate_summary_out
from deployments.api.images import ImageOutput
from deployments.api.logprobs import chat_logprobs, completion_logprobs, mean_logprob
from deployments.api.response_models import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    DeltaMessage,
    MoloraInfo,
    TokenAttributionOut,
    Usage,
)
from deployments.api.tool_calls import ToolCallShaping
from deployments.catalog.model_names import Resolved
from deployments.replica.wire import (
    DeltaItem,
    InfoItem,
    LogprobItem,
    ReplicaItem,
    TokenAttributionItem,
    UsageItem,
    decode,
)

Item = ReplicaItem


def sse(payload: Any) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def choices_asked(body: Any) -> tuple[int, int]:
    """(choices returned, choices generated): n, and best_of for completions."""
    n = body.n
    best_of = getattr(body, "best_of", None) or n
    return n, best_of


def head_info(head: list[Item]) -> InfoItem | None:
    """The `info` a started stream opened with (absent when it failed before any output)."""
    return head[0] if isinstance(head[0], InfoItem) else None


class Shaper:
    """Turns replica items into OpenAI responses and chunks (choices by their `index`)."""

    def __init__(
        self,
        body: Any,
        resolved: Resolved,
        chat: bool,
        request_id: str,
        images: bool = False,
        show_replica: bool = True,
    ) -> None:
        self.body, self.resolved, self.chat, self.id = body, resolved, chat, request_id
        self.show_replica = show_replica  # which replica served, hot-set hit, tier
        self.images = ImageOutput() if images and chat else None
        self.model = body.model
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.usage = Usage()
        self.sent_role: set[int] = set()
        self.info: InfoItem | None = None
        self.want_logprobs = body.top_logprobs_wanted() is not None
        self.n, self.best_of = choices_asked(body)
        self.offsets: dict[int, int] = {}  # completions' text_offset per choice (streaming)
        self.echo = bool(getattr(body, "echo", False))
        self.tools = ToolCallShaping.for_body(body, chat)  # tool calls read out of the text
        # Text-only deltas (no images, logprobs, attribution or tool calls asked) after a
        # choice's first chunk are written straight to SSE text from the wire dict: no model
        # per token.
        self.plain = self.images is None and not self.want_logprobs and self.tools is None
        self.plain = self.plain and not body.molora.return_attribution
        kind = "chat.completion.chunk" if chat else "text_completion"
        self._head = f'data: {{"id":{json.dumps(request_id)},"object":"{kind}","created":'
        self._middle = f',"model":{json.dumps(self.model)},"choices":[{{"index":'
        self._text_key = ',"delta":{"content":' if chat else ',"text":'

    def _echo(self, deltas: list[DeltaItem]) -> tuple[str, list[LogprobItem]]:
        """Echo's prompt text and its logprob items (from the choice's first delta)."""
        items = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), [])
        text = self.body.prompt_text()
        if text is None:
            text = "".join(i.token for i in items)
        return text, items

    def _logprobs(
        self, deltas: list[DeltaItem], offset: int = 0, prompt: list[LogprobItem] | None = None
    ) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        items = [lp for d in deltas for lp in d.logprobs or []]
        if self.chat:
            return chat_logprobs(items)
        return completion_logprobs([*(prompt or []), *items], offset)

    def _usage(self, item: UsageItem) -> None:
        p, c = item.prompt_tokens, item.completion_tokens
        self.usage = Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)

    def _info(
        self, with_replica: bool, attribution: list[TokenAttributionItem] | None
    ) -> MoloraInfo:
        info = self.info if with_replica and self.show_replica else None
        return MoloraInfo(
            route_kind=self.resolved.kind,
            versions=self.resolved.versions or None,
            replica=info.replica if info else None,
            hot_set_hit=info.hot_set_hit if info else None,
            tier=info.tier if info else None,
            attribution=[
                TokenAttributionOut(token_id=a.token_id, adapters=a.adapters) for a in attribution
            ]
            if attribution is not None
            else None,
        )

    def full(self, items: list[Item]) -> dict[str, Any]:
        by_index: dict[int, list[DeltaItem]] = {}
        for item in items:
            if isinstance(item, InfoItem):
                self.info = item
            elif isinstance(item, UsageItem):
                self._usage(item)
            elif isinstance(item, DeltaItem):
                by_index.setdefault(item.index, []).append(item)
        order = sorted(by_index)
        if self.best_of > self.n:  # best_of: the n choices with the best mean token logprob
            score = {
                i: mean_logprob([lp for d in by_index[i] for lp in d.logprobs or []]) for i in order
            }
            order = sorted(order, key=lambda i: -score[i])[: self.n]
        chat_choices: list[ChatChoice] = []
        text_choices: list[CompletionChoice] = []
        attribution = None
        for out_index, i in enumerate(order):
            deltas = by_index[i]
            text = "".join(d.text for d in deltas)
            finish = next((d.finish_reason for d in reversed(deltas) if d.finish_reason), None)
            stop_reason = next((d.stop_reason for d in reversed(deltas) if d.finish_reason), None)
            if self.body.molora.return_attribution and out_index == 0:
                attribution = [a for d in deltas for a in d.attribution or []]
            prompt: list[LogprobItem] = []
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
                    message.images = ImageOutput.all([t for d in deltas for t in d.token_ids])
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
        info.gate_summary = choice_summaries(by_index, order)
        if self.chat:
            return ChatCompletionResponse(
                id=self.id, model=self.model, choices=chat_choices, usage=self.usage, molora=info
            ).model_dump(exclude_none=True)
        return CompletionResponse(
            id=self.id, model=self.model, choices=text_choices, usage=self.usage, molora=info
        ).model_dump(exclude_none=True)

    def sse(self, item: Item | dict[str, Any]) -> str:
        """The SSE text of one item: a wire dict (a delta left undecoded on the hot path) or a
        typed item."""
        if isinstance(item, dict):
            if (
                self.plain
                and item["type"] == "delta"
                and item["finish_reason"] is None
                and item["index"] in self.sent_role
            ):
                return self._plain_delta(item)
            item = decode(item)
        return "".join(sse(chunk) for chunk in self.chunks(item))

    def _plain_delta(self, raw: dict[str, Any]) -> str:
        """`chunks`' output for a text-only, unfinished delta of a choice already started, as
        SSE text (a choice's last chunk, with its finish and stop reasons, takes `chunks`)."""
        text = raw["text"]
        if not text:
            return ""
        close = "}" if self.chat else ""
        return (
            f"{self._head}{int(time.time())}{self._middle}{raw['index']}{self._text_key}"
            f"{json.dumps(text)}{close}}}]}}\n\n"
        )

    def chunks(self, item: Item) -> list[dict[str, Any]]:
        if isinstance(item, InfoItem):
            self.info = item
            return []
        if isinstance(item, UsageItem):
            self._usage(item)
            return []
        if not isinstance(item, DeltaItem):
            return []
        text, finish, index = item.text, item.finish_reason, item.index
        calls = None
        if self.tools is not None:
            text, calls, finish = self.tools.delta(index, text, finish)
        first = index not in self.sent_role
        images = self.images.feed(index, item.token_ids, finish is not None) if self.images else []
        if not (text or calls or first or item.logprobs or images) and finish is None:
            return []
        info = None
        if (first and not self.sent_role) or item.attribution:
            info = self._info(not self.sent_role, item.attribution)
        if item.gate_summary is not None:  # on the choice's finishing chunk
            info = info or self._info(False, None)
            info.gate_summary = [gate_summary_out(index, item.gate_summary)]
        offset = self.offsets.get(index, 0)
        prompt: list[LogprobItem] = []
        if self.echo and first:
            prompt_text, prompt = self._echo([item])
            text = prompt_text + text
        logprobs = None
        if item.logprobs or finish or prompt:
            logprobs = self._logprobs([item], offset, prompt)
        if logprobs is not None and not self.chat:
            self.offsets[index] = offset + sum(
                len(lp.token) for lp in [*prompt, *(item.logprobs or [])]
            )
        if self.chat:
            delta = DeltaMessage(content=text, images=images or None, tool_calls=calls)
            if first:
                delta.role = "assistant"
            chunk: Any = ChatCompletionChunk(
                id=self.id,
                model=self.model,
                choices=[
                    ChatChunkChoice(
                        index=index,
                        delta=delta,
                        finish_reason=finish,
                        stop_reason=item.stop_reason,
                        logprobs=logprobs,
                    )
                ],
                molora=info,
            )
        else:
            chunk = CompletionChunk(
                id=self.id,
                model=self.model,
                choices=[
                    CompletionChoice(
                        index=index,
                        text=text,
                        finish_reason=finish,
                        stop_reason=item.stop_reason,
                        logprobs=logprobs,
                    )
                ],
                molora=info,
            )
        self.sent_role.add(index)
        return [chunk.model_dump(exclude_none=True)]

    def usage_chunk(self) -> dict[str, Any]:
        cls = ChatCompletionChunk if self.chat else CompletionChunk
        return cls(id=self.id, model=self.model, choices=[], usage=self.usage).model_dump(
            exclude_none=True
        )
