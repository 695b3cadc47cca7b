"""The router reads a stream channel in batches: what arrived while it was busy goes out in one
SSE write per request, in order, and a channel lost mid-batch still delivers what came first."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from deployments.api.handler import RequestHandler
from deployments.api.request_models import ChatCompletionRequest
from deployments.api.response_shape import ResponseShape
from deployments.api.shaping import Shaper
from deployments.api.tracking import Tracker
from deployments.api.upstream import Upstream
from deployments.catalog.model_names import Resolved
from deployments.protocol.wire import DeltaItem, ErrorItem, InfoItem, UsageItem
from deployments.replica.stream_channel import CHANNEL_LOST, ChannelClient
from molora_runtime.routes import BaseRoute

KEY = "chatcmpl-test"


class _Stream:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _Router:
    """The router's streaming path on a bare object (no Serve replica, no HTTP app)."""

    def __init__(self) -> None:
        self.channels = ChannelClient(lambda replica: None)
        self.channels.register(KEY)
        self.upstream = Upstream(None, "channel", self.channels)  # type: ignore[arg-type]
        self._items = self.upstream.items
        handler = RequestHandler.__new__(RequestHandler)
        handler.upstream = self.upstream
        self._sse = handler.stream


def _router() -> Any:
    return _Router()


def _head() -> list[Any]:
    return [
        InfoItem(replica="r1", hot_set_hit=True, channel=True),
        DeltaItem(text="A", token_ids=[1]),
    ]


def _wire(item: Any) -> dict[str, Any]:
    return item.model_dump(mode="json")


def _text(item: Any) -> str:
    """A delta's text (a wire dict past the head, a typed item in it); "usage" for usage."""
    if isinstance(item, dict):
        return item["text"]
    return "usage" if isinstance(item, UsageItem) else item.text


def _resolved() -> Resolved:
    return Resolved(route=BaseRoute(), placement_adapters=())


def _body() -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "base", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    )


async def _batches(router: Any, stream: _Stream) -> list[list[Any]]:
    out = []
    async for batch in router._items(stream, _head(), Tracker("base", "base", "tiny-base"), KEY):
        out.append(batch)
    return out


async def test_items_waiting_in_the_channel_come_as_one_batch() -> None:
    router, stream = _router(), _Stream()
    queue = router.channels.queue_of(KEY)
    for text in ("B", "C", "D"):
        queue.put_nowait(_wire(DeltaItem(text=text, token_ids=[2])))
    queue.put_nowait(_wire(UsageItem(prompt_tokens=3, completion_tokens=4)))
    batches = await asyncio.wait_for(_batches(router, stream), 2)
    assert [len(b) for b in batches] == [2, 4]  # the head, then everything that had arrived
    assert [i["text"] for i in batches[1][:3]] == ["B", "C", "D"]  # deltas stay wire dicts
    assert isinstance(batches[1][3], UsageItem)
    assert stream.cancelled and router.channels.queue_of(KEY) is None  # cleaned up


async def test_batches_follow_arrival_and_stop_at_the_last_item() -> None:
    router, stream = _router(), _Stream()
    queue = router.channels.queue_of(KEY)

    async def feed() -> None:
        queue.put_nowait(_wire(DeltaItem(text="B", token_ids=[2])))
        await asyncio.sleep(0.05)
        queue.put_nowait(_wire(DeltaItem(text="C", token_ids=[3], finish_reason="length")))
        queue.put_nowait(_wire(UsageItem(prompt_tokens=1, completion_tokens=3)))
        queue.put_nowait(_wire(DeltaItem(text="late", token_ids=[9])))  # after usage: dropped

    feeder = asyncio.create_task(feed())
    batches = await asyncio.wait_for(_batches(router, stream), 2)
    await feeder
    texts = [[_text(i) for i in b if not isinstance(i, InfoItem)] for b in batches]
    assert texts == [["A"], ["B"], ["C", "usage"]]


async def test_a_lost_channel_delivers_what_came_before_it_then_fails() -> None:
    router, stream = _router(), _Stream()
    queue = router.channels.queue_of(KEY)
    queue.put_nowait(_wire(DeltaItem(text="B", token_ids=[2])))
    queue.put_nowait(CHANNEL_LOST)
    got: list[list[Any]] = []
    with pytest.raises(RuntimeError, match="stream channel"):
        async for batch in router._items(
            stream, _head(), Tracker("base", "base", "tiny-base"), KEY
        ):
            got.append(batch)
    assert [_text(i) for i in got[1]] == ["B"]
    assert stream.cancelled


def _events(text: str) -> list[Any]:
    return [
        json.loads(part[len("data: ") :]) if part != "data: [DONE]" else "[DONE]"
        for part in text.split("\n\n")
        if part
    ]


async def _sse_writes(router: Any) -> list[str]:
    shaper = Shaper(ResponseShape.of(_body(), _resolved(), True, KEY))
    writes = []
    async for write in router._sse(
        _Stream(), _head(), shaper, Tracker("base", "base", "tiny-base")
    ):
        writes.append(write)
    return writes


async def test_one_sse_write_per_batch_with_every_chunk_in_order() -> None:
    router = _router()
    queue = router.channels.queue_of(KEY)
    queue.put_nowait(_wire(DeltaItem(text="B", token_ids=[2])))
    queue.put_nowait(_wire(DeltaItem(text="C", token_ids=[3], finish_reason="length")))
    queue.put_nowait(_wire(UsageItem(prompt_tokens=1, completion_tokens=3)))
    writes = await asyncio.wait_for(_sse_writes(router), 2)
    assert len(writes) == 3  # head, the batch of two chunks, [DONE]
    events = [e for w in writes for e in _events(w)]
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == ["A", "B", "C"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(_events(writes[1])) == 2


async def test_an_error_mid_batch_ends_the_stream_after_what_came_first() -> None:
    router = _router()
    queue = router.channels.queue_of(KEY)
    queue.put_nowait(_wire(DeltaItem(text="B", token_ids=[2])))
    queue.put_nowait(_wire(ErrorItem(status=503, message="replica stopping")))
    queue.put_nowait(_wire(DeltaItem(text="never", token_ids=[5])))
    writes = await asyncio.wait_for(_sse_writes(router), 2)
    events = [e for w in writes for e in _events(w)]
    assert events[1]["choices"][0]["delta"]["content"] == "B"
    assert events[2]["error"]["code"] == 503
    assert events[2]["error"]["message"] == "replica stopping"
    assert events[-1] == "[DONE]" and len(events) == 4


def test_the_lost_marker_survives_serves_copy_of_the_router_class() -> None:
    # Serve hands the router's methods their own copy of the module globals: the marker the
    # channel client puts in a queue must still equal the one the router compares against.
    seen = Upstream.channel_items.__globals__["CHANNEL_LOST"]
    assert seen == CHANNEL_LOST
    assert CHANNEL_LOST != {"type": "delta"}
