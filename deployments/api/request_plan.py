"""One request's plan: the body parsed, checked, admitted and resolved once, in one place.

`RequestPlanner.plan` turns the HTTP request into a `RequestPlan` that carries everything the
later steps need: the engine request (route pinned to versions, sampling, prompt, images,
grammar), the adapters placement should co-locate, the response's shape and the bounded metric
label, with the quota lease it took. After it nothing reads the raw body again: the upstream
call takes the plan, the shaper its `ResponseShape`, the tracker its label.

The steps keep the order an abuser cannot exploit: the body is bounded and parsed, the quota is
taken before any catalog or image work, and a refusal after admission ends the lease at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request

from deployments.access.auth import Principal
from deployments.access.gate import Access
from deployments.access.tenancy import metric_label, store_keys
from deployments.api.engine_request import Body, check_echo_size, engine_request
from deployments.api.http_errors import ApiError, read_payload
from deployments.api.images import ImagePartError, request_images
from deployments.api.request_models import ChatCompletionRequest, CompletionRequest
from deployments.api.response_shape import ResponseShape
from deployments.api.tracking import route_label
from deployments.catalog.model_names import (
    BadModelName,
    CatalogCache,
    ModelNotFound,
    Resolved,
)
from deployments.catalog.name_lookup import NameLookup
from deployments.config import ServeConfig
from molora_runtime.engine.types import GenerationRequest

Lease = Callable[..., None]  # `end(tokens_used, ok, prompt_counted=True)`, called once


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """Everything a generation request needs past parsing; see the module docstring."""

    engine: GenerationRequest
    placement_adapters: tuple[str, ...]
    shape: ResponseShape
    label: str  # the bounded `adapter` metric label
    lease: Lease

    @property
    def choices(self) -> int:
        """Choices the replica generates."""
        return self.shape.best_of


class RequestPlanner:
    """Parses, admits and resolves `/v1/completions` and `/v1/chat/completions` requests."""

    def __init__(
        self, cfg: ServeConfig, access: Access, catalog: CatalogCache, lookup: NameLookup
    ) -> None:
        self.cfg, self.access, self.catalog, self.lookup = cfg, access, catalog, lookup

    async def plan(self, request: Request, chat: bool, principal: Principal) -> RequestPlan:
        """The request's plan; raises `ApiError` (lease ended) or `AccessError` (not taken)."""
        server = self.cfg.server
        raw = await request.body()
        model_cls = ChatCompletionRequest if chat else CompletionRequest
        body = read_payload(raw, model_cls, server.max_request_bytes, server.max_json_depth)
        check_echo_size(body)
        max_tokens = body.requested_max_tokens() or server.default_max_tokens
        # Every choice may run to max_tokens: the token quota is charged for all of them;
        # the body's bytes bound its prompt tokens, charged if the request is dropped.
        lease = self.access.admit(principal, max_tokens * body.choice_counts()[1], len(raw))
        try:
            resolved = await self.resolve(body, principal)
            images = await self.images(body)
            gen = engine_request(
                body, resolved, chat, server.default_max_tokens, images, principal.tenant
            )
            alias = body.model if body.model in self.cfg.expose.routes else None
            alias = None if body.molora.route else alias
            label = metric_label(route_label(resolved, alias), resolved, await self.catalog.get())
        except ApiError:
            lease(0, False)
            raise
        # Which replica served and whether its hot-set already held the adapter tell of other
        # tenants' traffic: with API keys on, admins only.
        show_replica = principal.admin or not server.auth.enabled
        shape = ResponseShape.of(
            body, resolved, chat, gen.request_id, gen.image_output, show_replica
        )
        return RequestPlan(gen, resolved.placement_adapters, shape, label, lease)

    async def resolve(self, body: Body, principal: Principal) -> Resolved:
        """The body's route, pinned; the names an unknown model may mean are read from the
        store alone first (deployments/catalog/name_lookup.py), so a just-published adapter is
        found whatever the store holds."""
        explicit = body.molora.route
        for attempt in range(2):
            catalog = await self.catalog.get()
            resolver = self.access.resolver(principal, catalog, self.cfg)
            try:
                return resolver.resolve(body.model, explicit)
            except BadModelName as exc:
                raise ApiError(400, str(exc), "model") from None
            except ModelNotFound as exc:
                keys = store_keys(exc.names, principal.tenant)
                if attempt == 0 and keys and await self.lookup.find(keys, catalog):
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
