"""Stream channels (deployments/replica/stream_channel.py): batching on the replica, demux on the router,
and what a request sees when its channel ends under it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from deployments.replica.stream_channel import CHANNEL_LOST, ChannelClient, Outboxes


class FakeStream:
    """An async iterator over an async generator, with the `cancel()` of Ray's stream."""

    def __init__(self, gen: AsyncIterator[Any]) -> None:
        self._gen = gen
        self.cancelled = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Any:
        return await self._gen.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


async def _next(queue: asyncio.Queue[Any]) -> Any:
    return await asyncio.wait_for(queue.get(), 2)


async def test_items_of_many_requests_travel_in_one_batch() -> None:
    boxes = Outboxes()
    stream = boxes.serve("router-1", idle_close_s=5)
    assert await anext(stream) == []  # hello: attached
    box = boxes.open("router-1")
    assert box is not None and box.active == 1
    for key in ("a", "b", "c"):
        assert box.put(key, {"type": "delta", "text": key})
    batch = await anext(stream)
    assert batch == [["a", {"type": "delta", "text": "a"}], ["b", {"type": "delta", "text": "b"}],
                     ["c", {"type": "delta", "text": "c"}]]  # fmt: skip
    await stream.aclose()
    assert boxes.open("router-1") is None and len(boxes) == 0
    assert not box.put("a", {"type": "delta"})  # gone: the request aborts


async def test_unattached_channel_means_per_request_streaming() -> None:
    assert Outboxes().open("nobody") is None


async def test_idle_channel_closes_only_when_no_request_uses_it() -> None:
    boxes = Outboxes()
    stream = boxes.serve("r", idle_close_s=0.05)
    await anext(stream)
    box = boxes.open("r")
    assert box is not None
    waiter = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.2)  # idle, but a request is active: stays open
    assert not waiter.done()
    box.put("k", {"type": "usage"})
    assert await asyncio.wait_for(waiter, 2) == [["k", {"type": "usage"}]]
    box.active -= 1
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(stream), 2)
    assert boxes.open("r") is None


async def test_reopening_a_channel_ends_the_old_stream() -> None:
    boxes = Outboxes()
    old = boxes.serve("r", idle_close_s=5)
    await anext(old)
    new = boxes.serve("r", idle_close_s=5)
    await anext(new)
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(old), 2)
    box = boxes.open("r")
    assert box is not None and box.put("k", {"type": "usage"})
    assert await anext(new) == [["k", {"type": "usage"}]]
    await new.aclose()


async def test_router_demultiplexes_batches_into_request_queues() -> None:
    boxes = Outboxes()
    client = ChannelClient(lambda replica: FakeStream(boxes.serve("ch", idle_close_s=5)))
    qa, qb = client.register("a"), client.register("b")
    client.on_replica("a", "rep-1", via_channel=False)  # opens rep-1's channel
    for _ in range(100):
        if boxes.open("ch") is not None:
            break
        await asyncio.sleep(0.01)
    box = boxes.open("ch")
    assert box is not None and client.alive("rep-1")
    box.put("a", {"n": 1})
    box.put("gone", {"n": 0})  # a request the router forgot (its client left): dropped
    box.put("b", {"n": 2})
    box.put("a", {"n": 3})
    assert [await _next(qa), await _next(qa), await _next(qb)] == [{"n": 1}, {"n": 3}, {"n": 2}]
    await client.close()


async def test_a_channel_is_not_a_call_of_the_request_that_opened_it() -> None:
    """Serve cancels every call made in a request's context when that request's client leaves;
    a channel opened while one request was handled must not be one of them, or the requests
    queued on it would fail with it."""
    from ray.serve import context as serve_context

    seen: list[str] = []

    def open_channel(replica: str) -> FakeStream:
        seen.append(serve_context._get_serve_request_context()._internal_request_id)
        return FakeStream(Outboxes().serve("ch", idle_close_s=5))

    client = ChannelClient(open_channel)
    serve_context._serve_request_context.set(
        serve_context._RequestContext(
            _internal_request_id="the-opener", cancel_on_parent_request_cancel=True
        )
    )
    client.register("a")
    client.on_replica("a", "rep-1", via_channel=False)
    for _ in range(100):
        if seen:
            break
        await asyncio.sleep(0.01)
    assert seen and seen[0] != "the-opener"
    await client.close()


async def test_a_lost_channel_fails_only_its_own_requests() -> None:
    feeds: dict[str, asyncio.Queue[Any]] = {"rep-1": asyncio.Queue(), "rep-2": asyncio.Queue()}

    async def feed(replica: str) -> AsyncIterator[Any]:
        yield []
        while (batch := await feeds[replica].get()) is not None:
            if isinstance(batch, Exception):
                raise batch
            yield batch

    client = ChannelClient(lambda replica: FakeStream(feed(replica)))
    q1, q2 = client.register("one"), client.register("two")
    client.on_replica("one", "rep-1", via_channel=False)
    client.on_replica("two", "rep-2", via_channel=False)
    await asyncio.sleep(0.05)
    feeds["rep-1"].put_nowait([["one", {"type": "delta"}]])
    feeds["rep-2"].put_nowait([["two", {"type": "delta"}]])
    assert await _next(q1) == {"type": "delta"} and await _next(q2) == {"type": "delta"}
    feeds["rep-1"].put_nowait(RuntimeError("actor died"))
    assert await _next(q1) == CHANNEL_LOST
    assert not client.alive("rep-1") and client.alive("rep-2")
    feeds["rep-2"].put_nowait([["two", {"type": "usage"}]])
    assert await _next(q2) == {"type": "usage"}  # the other replica's stream goes on
    # A request the replica put on a channel that is already gone fails at once.
    q3 = client.register("three")
    client.on_replica("three", "rep-9-never-opened", via_channel=True)
    assert await _next(q3) == CHANNEL_LOST
    await client.close()


async def test_a_channel_that_never_says_hello_gives_up() -> None:
    async def silent(_: str) -> AsyncIterator[Any]:
        await asyncio.sleep(3600)
        yield []

    streams: list[FakeStream] = []

    def open_channel(replica: str) -> FakeStream:
        streams.append(FakeStream(silent(replica)))
        return streams[-1]

    client = ChannelClient(open_channel, hello_timeout_s=0.05, retry_after_s=0.5)
    client.register("k")
    client.on_replica("k", "rep-1", via_channel=False)
    await asyncio.sleep(0.3)
    assert not client.alive("rep-1") and streams[0].cancelled
    client.ensure("rep-1")  # failed just now: no retry storm
    await asyncio.sleep(0.01)
    assert len(streams) == 1
    await asyncio.sleep(0.5)
    client.ensure("rep-1")  # a later request tries again
    await asyncio.sleep(0.01)
    assert len(streams) == 2
    await client.close()


async def test_a_large_step_goes_out_as_several_messages_under_the_limit() -> None:
    boxes = Outboxes()
    stream = boxes.serve("router-big", idle_close_s=5)
    assert await anext(stream) == []
    box = boxes.open("router-big")
    assert box is not None
    for i in range(10):  # ten 300 KB items: one step of three requests' echoes
        assert box.put(f"r{i % 3}", {"type": "delta", "text": "x", "i": i}, size=300_000)
    batches = [await anext(stream) for _ in range(4)]
    assert [len(b) for b in batches] == [3, 3, 3, 1]  # 1 MB per message at most
    assert [item["i"] for b in batches for _, item in b] == list(range(10))  # order kept
    box.put("r0", {"type": "delta", "text": "big"}, size=5_000_000)  # alone, past the target
    assert await anext(stream) == [["r0", {"type": "delta", "text": "big"}]]
    await stream.aclose()


def test_an_item_too_large_to_send_fails_its_own_request() -> None:
    from deployments.protocol.wire import ITEM_BYTES, DeltaItem, LogprobItem, TopLogprobItem, encode
    from deployments.replica.fanout import bounded

    top = [TopLogprobItem(token_id=i, token=f"tok{i}", logprob=-1.0) for i in range(20)]
    prompt = [LogprobItem(token_id=1, token="word", logprob=-0.5, top=top) for _ in range(3000)]
    item = encode(DeltaItem(text="", token_ids=[1], prompt_logprobs=prompt))
    out, _ = bounded(item)
    assert out["type"] == "error" and out["status"] == 400 and "logprobs" in out["message"]
    assert len(json.dumps(item)) > ITEM_BYTES  # the estimate was not too cautious here
    small = encode(DeltaItem(text="hi", token_ids=[1, 2]))
    assert bounded(small)[0] is small
