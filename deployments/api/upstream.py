"""The router's side of one request's trip to a model replica: send, first output, items.

`start` sends the request through the model handle (whose request router picks the replica)
and waits for its first output past `info`, so errors get a real status before any header is
sent; `items` yields the rest in batches, from the replica's stream channel when one carries
it (deployments/replica/stream_channel.py), else from the call's own stream. Cancelling the
consumer cancels the replica call, which aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from deployments.api.http_errors import ApiError
from deployments.api.request_plan import RequestPlan
from deployments.api.shaping import Item, head_info
from deployments.api.tracking import Tracker
from deployments.placement.request_router import PLACEMENT_KWARG, TARGET_KWARG
from deployments.protocol.wire import ErrorItem, InfoItem, UsageItem, decode
from deployments.replica.stream_channel import CHANNEL_LOST, ChannelClient
from molora_runtime.engine.types import GenerationRequest

logger = logging.getLogger("ray.serve")


class Upstream:
    """Requests to the model replicas, and this router's stream channels from them."""

    def __init__(
        self, model: DeploymentHandle, channel_id: str, channels: ChannelClient | None
    ) -> None:
        self.model = model
        self.channel_id = channel_id
        self.channels = channels

    def open_channel(self, replica: str) -> Any:
        """This router's stream channel from one model replica."""
        return self.model.options(stream=True).channel.remote(
            self.channel_id, **{TARGET_KWARG: replica}
        )

    async def start(self, plan: RequestPlan) -> tuple[Any, list[Item]]:
        """Send the planned request and wait for its first output (past `info`), so errors — an
        adapter that cannot load included — still get a real status before any header is sent."""
        req = plan.engine
        payload = req.model_dump(mode="json")
        placement = {"adapters": list(plan.placement_adapters)}
        extra: dict[str, Any] = {"n": plan.choices} if plan.choices > 1 else {}
        if self.channels is not None:
            extra["channel"] = self.channel_id
            self.channels.register(req.request_id)
        try:
            stream, head = await self._send(req, payload, placement, extra)
        except BaseException:
            self.forget(req.request_id)
            raise
        info = head_info(head)
        if self.channels is not None and info is not None:
            self.channels.on_replica(req.request_id, info.replica, info.channel)
        return stream, head

    def forget(self, key: str) -> None:
        if self.channels is not None:
            self.channels.unregister(key)

    async def _send(
        self,
        req: GenerationRequest,
        payload: dict[str, Any],
        placement: dict[str, Any],
        extra: dict[str, Any],
    ) -> tuple[Any, list[Item]]:
        for attempt in range(2):
            stream = self.model.options(stream=True).generate.remote(
                payload, **{PLACEMENT_KWARG: placement}, **extra
            )
            head: list[Item] = []
            try:
                while not head or isinstance(head[-1], InfoItem):
                    head.extend(decode(raw) for raw in await stream.__anext__())
            except StopAsyncIteration:
                stream.cancel()
                raise ApiError(500, "the replica ended the stream without output") from None
            except BackPressureError as exc:
                raise ApiError(503, f"server overloaded, retry later: {exc}") from None
            except asyncio.CancelledError:
                stream.cancel()
                raise
            except ValidationError as exc:
                stream.cancel()
                logger.error("request %s: malformed replica item: %s", req.request_id, exc)
                raise ApiError(500, "internal error: the replica sent a malformed item") from None
            except Exception as exc:
                # The replica died before producing anything: nothing was sent, so try another.
                logger.warning("request %s failed to start: %r", req.request_id, exc)
                stream.cancel()
                if attempt == 0:
                    continue
                raise ApiError(
                    503, f"no model replica could take the request: {type(exc).__name__}"
                ) from None
            last = next(i for i in head if not isinstance(i, InfoItem))  # the first output
            if isinstance(last, ErrorItem):
                stream.cancel()
                raise ApiError(last.status, last.message, last.param)
            return stream, head
        raise AssertionError("unreachable")

    async def items(
        self, stream: Any, head: list[Item], tracker: Tracker, key: str
    ) -> AsyncIterator[list[Item | dict[str, Any]]]:
        """A started stream's items up to `usage` or `error`, in batches: the head, then what
        had arrived by the time the consumer asked (from the stream channel when the replica
        routed them there), so a router that fell behind catches up in one write per request,
        not one per token; deltas past the head come as wire dicts. Cancelling the consumer
        cancels the replica call."""
        try:
            for item in head:
                tracker.on_item(item)
            yield head
            if isinstance(head[-1], UsageItem | ErrorItem):
                return
            info = head_info(head)
            via_channel = self.channels is not None and info is not None and info.channel
            source = self.channel_items(key) if via_channel else self.stream_items(stream)
            async with contextlib.aclosing(source) as raws:
                async for batch in raws:
                    items: list[Item] = []
                    for raw in batch:
                        # Deltas stay wire dicts (shaped straight to SSE text); the rest,
                        # once per request, are decoded into typed items.
                        item = raw if raw.get("type") == "delta" else decode(raw)
                        tracker.on_item(item)
                        items.append(item)
                        if isinstance(item, UsageItem | ErrorItem):
                            yield items
                            return
                    yield items
        finally:
            stream.cancel()
            self.forget(key)

    @staticmethod
    async def stream_items(stream: Any) -> AsyncIterator[list[Any]]:
        async for batch in stream:  # the call's own messages: lists of wire items
            yield batch

    async def channel_items(self, key: str) -> AsyncIterator[list[Any]]:
        queue = self.channels.queue_of(key) if self.channels is not None else None
        if queue is None:
            raise RuntimeError("the request's stream channel entry is gone")
        while True:
            batch = [await queue.get()]
            while not queue.empty() and batch[-1] != CHANNEL_LOST:
                batch.append(queue.get_nowait())
            if batch[-1] == CHANNEL_LOST:
                if len(batch) > 1:
                    yield batch[:-1]
                raise RuntimeError("the stream channel from the model replica ended")
            yield batch
