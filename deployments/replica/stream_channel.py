"""Stream channels: one Ray stream per (router, model replica) that carries every request's items.

Without them each request streams its own items through Serve, so a decode step of 32
sequences costs 32 Ray messages (each pickled, sent and woken on both sides) on a box where
that CPU is taken from the engine. With a channel the replica drains what all of one router's
requests produced since the last send into one message: one per step, not one per sequence.
A message stays under `wire.MESSAGE_BYTES` (a larger step goes out as several), so one
request's large items never make a message the transport refuses, which would end the channel
and every stream on it.

The per-request `generate` call stays what it was for everything but the items after the
first output: placement, Serve's ongoing-request count (load, backpressure, autoscaling) and
cancellation (the client went away -> the router cancels the call -> the replica aborts the
request) still ride on it; it only stops carrying deltas once a channel is open.

Replica side: `Outboxes` holds one `Outbox` per attached router; `generate` uses it only when
that router's channel is attached at the request's start (the first `info` item says so), so
a request never waits on a channel that does not exist. A channel closes itself after
`IDLE_CLOSE_S` without a request using it, which lets a draining replica finish.

Router side: `ChannelClient` opens a replica's channel the first time it meets that replica and
hands each item to the queue of its request. When a channel ends while requests still wait
on it (the replica died), each of them gets `CHANNEL_LOST` and fails with a 503 mid-stream;
requests on other replicas and channels go on.

No Ray here: the deployments hand in the stream-opening function.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from deployments.protocol.wire import MESSAGE_BYTES, approx_size

logger = logging.getLogger("ray.serve")

IDLE_CLOSE_S = 5.0
HELLO_TIMEOUT_S = 30.0
RETRY_AFTER_S = 1.0  # a channel that failed is not reopened sooner (a full replica: no storm)
# Put into a request's queue when its channel ended under it. A string compared by equality,
# not an `object()` compared by identity: Serve copies the router class by value into its
# replica, and with it the globals its methods see, so an identity sentinel would not match.
CHANNEL_LOST = "<stream channel lost>"

Batch = list[list[Any]]  # [[request key, wire item], ...]


class Outbox:
    """What one router's requests produced on this replica since the last send."""

    def __init__(self, message_bytes: int = MESSAGE_BYTES) -> None:
        self._items: Batch = []
        self._sizes: list[int] = []
        self._ready = asyncio.Event()
        self._message_bytes = message_bytes
        self.active = 0  # requests streaming through this outbox now
        self.closed = False

    def put(self, key: str, item: dict[str, Any], size: int | None = None) -> bool:
        """Queue an item (`size`: its `approx_size`, when the caller has it); False once the
        channel is gone (the caller aborts its request)."""
        if self.closed:
            return False
        self._items.append([key, item])
        self._sizes.append(approx_size(item) if size is None else size)
        self._ready.set()
        return True

    async def drain(self, timeout_s: float) -> Batch | None:
        """What is queued, up to one message's bytes (at least one item; the rest waits for the
        next drain); waits for the first item up to `timeout_s` (None: none came)."""
        if not self._items:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), timeout_s)
        if not self._items:
            self._ready.clear()
            return None
        take, total = 0, 0
        for size in self._sizes:
            if take and total + size > self._message_bytes:
                break
            take, total = take + 1, total + size
        items, self._items = self._items[:take], self._items[take:]
        self._sizes = self._sizes[take:]
        if not self._items:
            self._ready.clear()
        return items

    def close(self) -> None:
        self.closed = True
        self._ready.set()


class Outboxes:
    """The replica's attached channels, by the router's channel id."""

    def __init__(self) -> None:
        self._boxes: dict[str, Outbox] = {}

    def __len__(self) -> int:
        return len(self._boxes)

    def open(self, channel_id: str) -> Outbox | None:
        """The attached outbox of `channel_id`, counted as used by one more request."""
        box = self._boxes.get(channel_id)
        if box is None or box.closed:
            return None
        box.active += 1
        return box

    async def serve(
        self, channel_id: str, idle_close_s: float = IDLE_CLOSE_S
    ) -> AsyncIterator[Batch]:
        """The channel's stream: an empty hello, then batches until idle (or cancelled)."""
        previous = self._boxes.get(channel_id)
        if previous is not None:  # the router reopened it: the old stream ends
            previous.close()
        box = self._boxes[channel_id] = Outbox()
        try:
            yield []
            while not box.closed:
                batch = await box.drain(idle_close_s)
                if batch:
                    yield batch
                elif batch is None and box.active == 0:
                    return  # idle: a later request reopens it
        finally:
            box.close()
            if self._boxes.get(channel_id) is box:
                del self._boxes[channel_id]


class _Route:
    """One request's place on the router: its queue and, once known, its replica."""

    __slots__ = ("queue", "replica")

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.replica: str | None = None


class ChannelClient:
    """The router's end of the channels: opens them, demultiplexes their batches."""

    def __init__(
        self,
        open_channel: Callable[[str], Any],
        hello_timeout_s: float = HELLO_TIMEOUT_S,
        retry_after_s: float = RETRY_AFTER_S,
    ) -> None:
        self._open = open_channel  # replica id -> an async iterator of batches (cancellable)
        self._hello_timeout_s = hello_timeout_s
        self._retry_after_s = retry_after_s
        self._failed_at: dict[str, float] = {}
        self._routes: dict[str, _Route] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._alive: set[str] = set()

    # -- requests ---------------------------------------------------------------------------

    def register(self, key: str) -> asyncio.Queue[Any]:
        """Before the request is sent: where its channel items will land."""
        route = self._routes[key] = _Route()
        return route.queue

    def queue_of(self, key: str) -> asyncio.Queue[Any] | None:
        route = self._routes.get(key)
        return route.queue if route is not None else None

    def unregister(self, key: str) -> None:
        self._routes.pop(key, None)

    def on_replica(self, key: str, replica: str, via_channel: bool) -> None:
        """The request's `info` arrived: open that replica's channel for the next requests,
        and if this one streams through a channel that is already gone, fail it now."""
        route = self._routes.get(key)
        if route is not None:
            route.replica = replica
            if via_channel and replica not in self._alive:
                route.queue.put_nowait(CHANNEL_LOST)
        self.ensure(replica)

    # -- channels ---------------------------------------------------------------------------

    def ensure(self, replica: str) -> None:
        task = self._tasks.get(replica)
        if task is not None and not task.done():
            return
        loop = asyncio.get_running_loop()
        if loop.time() - self._failed_at.get(replica, -1e9) < self._retry_after_s:
            return  # it failed just now: those requests stream on their own calls meanwhile
        # A fresh context: the channel outlives the request that opened it, and a framework
        # that ties calls to the current request (Serve cancels them when its client leaves)
        # would otherwise end the channel, and every request on it, with that one request.
        self._tasks[replica] = loop.create_task(self._run(replica), context=contextvars.Context())

    def alive(self, replica: str) -> bool:
        return replica in self._alive

    async def _run(self, replica: str) -> None:
        stream = self._open(replica)
        self._alive.add(replica)
        try:
            hello = await asyncio.wait_for(stream.__anext__(), self._hello_timeout_s)
            if hello != []:
                raise RuntimeError(f"unexpected channel hello {hello!r}")
            async for batch in stream:
                for key, item in batch:
                    route = self._routes.get(key)
                    if route is not None:  # else: the request is gone (client disconnect)
                        route.replica = replica
                        route.queue.put_nowait(item)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("stream channel to replica %s ended: %r", replica, exc)
            self._failed_at[replica] = asyncio.get_running_loop().time()
        finally:
            self._alive.discard(replica)
            if self._tasks.get(replica) is asyncio.current_task():
                del self._tasks[replica]  # replicas come and go: keep no dead entries
            with contextlib.suppress(Exception):
                stream.cancel()
            for route in self._routes.values():
                if route.replica == replica:
                    route.queue.put_nowait(CHANNEL_LOST)

    async def close(self) -> None:
        tasks = list(self._tasks.values())  # each task drops its own entry as it ends
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
