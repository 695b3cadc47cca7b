"""One request handler for the generation endpoints: auth -> admit -> parse -> resolve ->
start -> stream or collect.

It holds no tokenizer and no tensors; prompt-length checks happen in the replica and come back
as 400s. Quota leases end with the request (`Tracker.done`), whatever way it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from deployments.access.auth import Principal
from deployments.access.gate import Access, AccessError
from deployments.access.gate import error_response as access_error_response
from deployments.access.tenancy import metric_label
from deployments.api.engine_request import Body, check_echo_size, engine_request
from deployments.api.http_errors import ApiError, error_response, read_payload
from deployments.api.images import ImagePartError, request_images
from deployments.api.request_models import ChatCompletionRequest, CompletionRequest
from deployments.api.shaping import Item, Shaper, choices_asked, sse
from deployments.api.tracking import Tracker, route_label
from deployments.api.upstream import Upstream
from deployments.catalog.model_names import (
    BadModelName,
    CatalogCache,
    ModelNotFound,
    Resolved,
)
from deployments.config import ServeConfig
from deployments.protocol.openai_error import error_payload
from deployments.protocol.wire import ErrorItem

logger = logging.getLogger("ray.serve")


class RequestHandler:
    """Serves `/v1/completions` and `/v1/chat/completions` end to end."""

    def __init__(
        self, cfg: ServeConfig, access: Access, catalog: CatalogCache, upstream: Upstream
    ) -> None:
        self.cfg, self.access, self.catalog, self.upstream = cfg, access, catalog, upstream
        self._last_forced = 0.0

    async def handle(self, request: Request, chat: bool) -> Any:
        retry_after = self.access.load.retry_after()
        end = None
        try:
            principal = await self.access.authenticate(request)
            body = await self.parse(request, chat)
            check_echo_size(body)
            max_tokens = body.requested_max_tokens() or self.cfg.server.default_max_tokens
            # Every choice may run to max_tokens: the token quota is charged for all of them.
            prompt_bound = len(await request.body())  # bytes >= prompt tokens: charged on abort
            end = self.access.admit(principal, max_tokens * choices_asked(body)[1], prompt_bound)
            resolved = await self.resolve(body, principal)
            images = await self.images(body)
            gen_req = engine_request(
                body, resolved, chat, self.cfg.server.default_max_tokens, images, principal.tenant
            )
        except AccessError as exc:
            return access_error_response(exc)
        except ApiError as exc:
            if end is not None:
                end(0, False)
            return error_response(exc.status, exc.message, exc.param, retry_after)
        tracker = Tracker(resolved, self.cfg.base_model_name())
        alias = (
            body.model if body.model in self.cfg.expose.routes and not body.molora.route else None
        )
        tracker.label = metric_label(
            route_label(resolved, alias), resolved, await self.catalog.get()
        )
        tracker.on_done.append(lambda used, ok: end(used, ok, tracker.prompt_tokens > 0))
        try:
            stream, first = await self.upstream.start(gen_req, resolved, choices_asked(body)[1])
        except ApiError as exc:
            tracker.done(str(exc.status))
            return error_response(exc.status, exc.message, exc.param, retry_after)
        # Which replica served and whether its hot-set already held the adapter tell of other
        # tenants' traffic: with API keys on, admins only.
        shaper = Shaper(
            body, resolved, chat, gen_req.request_id, gen_req.image_output,
            show_replica=principal.admin or not self.cfg.server.auth.enabled,
        )  # fmt: skip
        if body.stream:
            return StreamingResponse(
                self.stream(stream, first, shaper, tracker),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": gen_req.request_id},
            )
        return await self.collect(stream, first, shaper, tracker)

    async def parse(self, request: Request, chat: bool) -> Body:
        server = self.cfg.server
        model_cls = ChatCompletionRequest if chat else CompletionRequest
        return read_payload(
            await request.body(), model_cls, server.max_request_bytes, server.max_json_depth
        )

    async def resolve(self, body: Body, principal: Principal) -> Resolved:
        explicit = body.molora.route
        for attempt in range(2):
            catalog = await self.catalog.get(force=attempt > 0)
            resolver = self.access.resolver(principal, catalog, self.cfg)
            try:
                return resolver.resolve(body.model, explicit)
            except BadModelName as exc:
                raise ApiError(400, str(exc), "model") from None
            except ModelNotFound as exc:
                # A name published seconds ago may not be in the cached catalog yet; unknown
                # names force a reload at most 10% of the time, whatever a reload costs.
                now = time.monotonic()
                if attempt == 0 and now - self._last_forced > max(1.0, 10 * self.catalog.load_s):
                    self._last_forced = now
                    continue
                param = "molora.route" if explicit is not None else "model"
                raise ApiError(404, str(exc), param) from None
        raise AssertionError("unreachable")

    @staticmethod
    async def images(body: Body) -> list[list[int]] | None:
        """The chat request's image parts as 8x8 grey levels (decoded off the event loop)."""
        if not isinstance(body, ChatCompletionRequest) or not body.has_images():
            return None
        try:
            return await asyncio.to_thread(request_images, body)
        except ImagePartError as exc:
            raise ApiError(400, str(exc), exc.param) from None

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
