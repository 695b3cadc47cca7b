"""One request handler for the generation endpoints: auth -> plan (parse, admit, resolve:
deployments/api/request_plan.py) -> start -> stream or collect.

It holds no tokenizer and no tensors; prompt-length checks happen in the replica and come back
as 400s. Quota leases end with the request (`Tracker.done`), whatever way it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from deployments.access.gate import Access, AccessError
from deployments.access.gate import error_response as access_error_response
from deployments.api.http_errors import ApiError, error_response
from deployments.api.request_plan import RequestPlanner
from deployments.api.shaping import Item, Shaper, sse
from deployments.api.tracking import Tracker
from deployments.api.upstream import Upstream
from deployments.catalog.model_names import CatalogCache
from deployments.catalog.name_lookup import NameLookup
from deployments.config import ServeConfig
from deployments.protocol.openai_error import error_payload
from deployments.protocol.wire import ErrorItem

logger = logging.getLogger("ray.serve")


class RequestHandler:
    """Serves `/v1/completions` and `/v1/chat/completions` end to end."""

    def __init__(
        self,
        cfg: ServeConfig,
        access: Access,
        catalog: CatalogCache,
        lookup: NameLookup,
        upstream: Upstream,
    ) -> None:
        self.cfg, self.access, self.upstream = cfg, access, upstream
        self.planner = RequestPlanner(cfg, access, catalog, lookup)

    async def handle(self, request: Request, chat: bool) -> Any:
        retry_after = self.access.load.retry_after()
        try:
            principal = await self.access.authenticate(request)
            plan = await self.planner.plan(request, chat, principal)
        except AccessError as exc:
            return access_error_response(exc)
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.param, retry_after)
        tracker = Tracker(plan.shape.route_kind, plan.label, self.cfg.base_model_name())
        tracker.on_done.append(lambda used, ok: plan.lease(used, ok, tracker.prompt_tokens > 0))
        try:
            stream, first = await self.upstream.start(plan)
        except ApiError as exc:
            tracker.done(str(exc.status))
            return error_response(exc.status, exc.message, exc.param, retry_after)
        shaper = Shaper(plan.shape)
        if plan.shape.stream:
            return StreamingResponse(
                self.stream(stream, first, shaper, tracker),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": plan.shape.request_id},
            )
        return await self.collect(stream, first, shaper, tracker)

    async def collect(
        self, stream: Any, head: list[Item], shaper: Shaper, tracker: Tracker
    ) -> JSONResponse:
        items: list[Item] = []
        source = self.upstream.items(stream, head, tracker, shaper.id)
        try:
            async with contextlib.aclosing(source) as batches:
                async for batch in batches:
                    for item in batch:
                        if isinstance(item, ErrorItem):
                            tracker.done(str(item.status))
                            return error_response(item.status, item.message, item.param)
                        items.append(item)
        except asyncio.CancelledError:
            tracker.done("cancelled")
            raise
        except Exception as exc:
            tracker.done("503")
            return error_response(
                503, f"the model replica failed mid-request: {type(exc).__name__}"
            )
        tracker.done("ok")
        return JSONResponse(shaper.full(items))

    async def stream(
        self, stream: Any, head: list[Item], shaper: Shaper, tracker: Tracker
    ) -> AsyncIterator[str]:
        status = "ok"
        source = self.upstream.items(stream, head, tracker, shaper.id)
        try:
            failed = False
            async with contextlib.aclosing(source) as batches:
                async for batch in batches:
                    out: list[str] = []
                    for item in batch:
                        if isinstance(item, ErrorItem):
                            status, failed = str(item.status), True
                            out.append(sse(error_payload(item.status, item.message, item.param)))
                            break
                        out.append(shaper.sse(item))
                    if out:
                        yield "".join(out)
                    if failed:
                        break
            if not failed and shaper.include_usage:
                yield sse(shaper.usage_chunk())
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        except Exception as exc:
            status = "503"
            logger.warning("stream failed mid-way: %r", exc)
            yield sse(
                error_payload(503, f"the model replica failed mid-stream: {type(exc).__name__}")
            )
        finally:
            tracker.done(status)
        yield sse("[DONE]")
