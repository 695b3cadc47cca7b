"""A replica's requests fed from the engine's per-step batches, in one pass per step.

The engine hands each step's increments to `Fanout.on_step` as one `StepOutputs`; for every
output the fanout finds its request (and choice, n > 1), forms the wire item once (a plain dict,
`deployments.protocol.wire`'s shapes, no model built per token) and puts it where it goes: the
request's own call until its first output is out, then the calling router's stream channel
outbox, so one channel message carries everything a router's requests produced in a step.
No per-request task wakes per token; the request's `generate` call only waits for its end.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict
from typing import Any

from deployments.protocol.errors import error_item, output_error
from deployments.protocol.logprob_items import logprob_items, prompt_items
from deployments.protocol.wire import ITEM_BYTES, ErrorItem, approx_size, encode
from deployments.replica.stream_channel import Outbox
from molora_runtime.engine.types import GenerationOutput, StepOutputs

logger = logging.getLogger("ray.serve")


def delta_wire(out: GenerationOutput, index: int = 0, tokenizer: Any = None) -> dict[str, Any]:
    """One engine increment of choice `index` as a wire `delta` (optional fields only when
    present); errors never come through here."""
    item: dict[str, Any] = {
        "type": "delta",
        "index": index,
        "text": out.text_delta,
        "token_ids": out.new_token_ids,
        "finish_reason": out.finish_reason if out.finished else None,
    }
    if out.finished and out.stop_reason is not None:
        item["stop_reason"] = out.stop_reason
    if out.attribution is not None:
        item["attribution"] = [
            {"token_id": a.token_id, "adapters": a.adapters} for a in out.attribution
        ]
    if out.logprobs is not None:
        item["logprobs"] = logprob_items(out.logprobs, tokenizer)
    if out.gate_summary is not None:
        item["gate_summary"] = asdict(out.gate_summary)
    if out.prompt_logprobs is not None and out.prompt_token_ids is not None:
        item["prompt_logprobs"] = prompt_items(out.prompt_token_ids, out.prompt_logprobs, tokenizer)
    return item


def bounded(item: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The item and its size, or a 400 for its own request when it is too large to send."""
    size = approx_size(item)
    if size <= ITEM_BYTES:
        return item, size
    error = ErrorItem(
        status=400,
        message=f"one response item would take ~{size} bytes, over the {ITEM_BYTES}-byte "
        "limit: ask fewer logprobs, fewer choices or a shorter echoed prompt",
    )
    return encode(error), 0


class Job:
    """One `generate` call: its choices' progress and where its items go."""

    __slots__ = ("box", "choices", "closed", "completion", "ended", "head", "info", "key", "routed")

    def __init__(self, key: str, choices: int, info: dict[str, Any], box: Outbox | None) -> None:
        self.key, self.choices, self.info, self.box = key, choices, info, box
        # Items for the call itself; None closes it (the last item is out, or the channel
        # is gone and the call aborts).
        self.head: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.closed = False
        self.routed = False  # past the first output: items go to the channel outbox
        self.ended = False  # usage or error is out
        self.completion: dict[int, int] = {}

    def emit(self, item: dict[str, Any], size: int | None = None) -> None:
        if self.closed:
            return
        if self.routed:
            if not self.box.put(self.key, item, size):  # type: ignore[union-attr]
                self.close()
                return
        else:
            self.head.put_nowait(item)
            self.routed = self.box is not None and item["type"] != "info"
        if item["type"] in ("usage", "error"):
            self.ended = True
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.head.put_nowait(None)

    def fail(self, item: ErrorItem) -> None:
        self.emit(encode(item))


class Fanout:
    """The replica's `StepSink`: routes each step's outputs to their requests' jobs."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._choices: dict[str, tuple[Job, int]] = {}  # engine request id -> (job, choice)

    def add(self, job: Job, request_ids: list[str]) -> None:
        for i, rid in enumerate(request_ids):
            self._choices[rid] = (job, i)

    def remove(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._choices.pop(rid, None)

    def on_step(self, step: StepOutputs) -> None:
        choices = self._choices
        for out in step.outputs:
            found = choices.get(out.request_id)
            if found is None:
                continue
            job, index = found
            try:
                self._feed(job, index, out)
            except Exception as exc:  # one request's item failing never stops the step
                logger.exception("request %s: forming its item failed", job.key)
                job.fail(error_item(exc))

    def _feed(self, job: Job, index: int, out: GenerationOutput) -> None:
        if job.closed:
            return
        if out.finish_reason == "error":
            job.fail(output_error(out))
            return
        if job.info is not None:
            job.emit(job.info)
            job.info = None
        item, size = bounded(delta_wire(out, index, self.tokenizer))
        job.emit(item, size)
        if out.finished and item["type"] == "delta":
            job.completion[index] = out.completion_tokens
            if len(job.completion) == job.choices:
                usage = {
                    "type": "usage",
                    "prompt_tokens": out.prompt_tokens,
                    "completion_tokens": sum(job.completion.values()),
                }
                job.emit(usage)

    def on_failure(self, exc: BaseException) -> None:
        for job, _ in list(self._choices.values()):
            job.fail(error_item(exc))
