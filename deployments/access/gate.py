"""The ingress' trust boundary in one object: who calls (API keys), what they may see (tenancy),
how much they may use (quotas) and when an overloaded server should be retried.

The ingress calls `authenticate` first on every API route, filters the catalog through
`visible`, `admit`s a request before it reaches a replica and calls the returned `end` when it
finishes. Refusals are `AccessError`s, answered by `error_response` in the OpenAI error shape.
Keys are never logged: messages name at most a key id.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from adapter_store.validate import load_base_config
from deployments.access.admission import PRINCIPAL_SCOPE_KEY, Admission
from deployments.access.auth import ANONYMOUS, KeyFileError, KeyRing, Principal, bearer_key
from deployments.access.overload import WaitEstimator
from deployments.access.quotas import QuotaBook, QuotaExceeded, retry_after_header
from deployments.access.tenancy import visible_catalog
from deployments.catalog.admin import AdminFailed, AdminNotFound, YankBody, set_yanked
from deployments.catalog.lora_admin import (
    LoadLoraBody,
    LoraAdminError,
    UnloadLoraBody,
    load_lora,
    unload_lora,
)
from deployments.catalog.model_names import Catalog, Resolver
from deployments.config import ServeConfig, ServerConfig, StoreConfig
from deployments.protocol.openai_error import error_payload
from molora_runtime.model.model_paths import resolve_model_path

logger = logging.getLogger("ray.serve")


class AccessError(Exception):
    """A refusal at the trust boundary (401, 403, 404, 400 or 429)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, retry_after: int | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after = (
            status,
            message,
            param,
            retry_after,
        )


def error_response(exc: AccessError) -> JSONResponse:
    headers: dict[str, str] = {}
    if exc.status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="molora"'
    if exc.retry_after is not None:
        headers["Retry-After"] = str(exc.retry_after)
    return JSONResponse(
        error_payload(exc.status, exc.message, exc.param), status_code=exc.status, headers=headers
    )


class Access:
    """Keys, quotas, visibility and the overload estimate of one ingress replica."""

    def __init__(self, server: ServerConfig, slots: int, root: Path) -> None:
        self.auth = server.auth
        try:
            self.keys = KeyRing(server.auth, root) if server.auth.enabled else None
        except (OSError, KeyFileError) as exc:
            raise KeyFileError(f"server.auth: cannot load API keys: {exc}") from None
        self.quotas = QuotaBook(server.quotas, lease_timeout_s=server.request_timeout_s)
        self.load = WaitEstimator(floor_s=server.retry_after_s, slots=slots)
        self.admission = Admission(
            server.admission, self.keys, server.quotas, server.max_request_bytes
        )
        # One entry per tenant (the key file bounds them) and the public view.
        self._resolvers: dict[str | None, tuple[Catalog, Resolver]] = {}

    def announce(self) -> None:
        """Say loudly at start when the endpoint is open to anyone who can reach it."""
        if self.keys is None:
            logger.warning(
                "server.auth is disabled: the OpenAI endpoint is UNAUTHENTICATED; anyone who "
                "can reach it may use every public adapter (enable server.auth for a shared "
                "deployment)"
            )
        else:
            source = self.auth.keys_file or f"${self.auth.keys_env}"
            logger.info("server.auth enabled: %d API key(s) from %s", len(self.keys), source)

    # -- who ------------------------------------------------------------------------------------

    async def authenticate(self, request: Request) -> Principal:
        if self.keys is None:
            return ANONYMOUS
        admitted = request.scope.get(PRINCIPAL_SCOPE_KEY)
        if isinstance(admitted, Principal):
            return admitted  # verified from the headers by AdmissionMiddleware
        key = bearer_key(request.headers.get("authorization"))
        if key is None:
            raise AccessError(401, "missing API key: send 'Authorization: Bearer <key>'", None)
        principal = await self.keys.verify_async(key)
        if principal is None:
            raise AccessError(401, "invalid API key", None)
        return principal

    # -- what -----------------------------------------------------------------------------------

    @staticmethod
    def visible(principal: Principal, catalog: Catalog) -> Catalog:
        return visible_catalog(catalog, principal.tenant)

    def resolver(self, principal: Principal, catalog: Catalog, config: ServeConfig) -> Resolver:
        """The caller's resolver over `catalog`, built once per catalog load and tenant: a
        request costs the same whatever the store holds (the view is a pass over every name)."""
        hit = self._resolvers.get(principal.tenant)
        if hit is not None and hit[0] is catalog:
            return hit[1]
        resolver = Resolver(config, visible_catalog(catalog, principal.tenant))
        self._resolvers[principal.tenant] = (catalog, resolver)
        return resolver

    # -- how much -------------------------------------------------------------------------------

    def admit(
        self, principal: Principal, max_tokens: int, prompt_bound: int = 0
    ) -> Callable[..., None]:
        """Take the request's quota; returns `end(tokens_used, ok, prompt_counted=True)` to call
        exactly once. A request that ends before its usage is known (cancelled, stream dropped)
        is charged `prompt_bound`, an upper bound of its prompt tokens (the body's byte count),
        so aborting after the first chunk does not make the prompt free."""
        try:
            lease = self.quotas.admit(principal, max_tokens, busy_s=self.load.service_s())
        except QuotaExceeded as exc:
            raise AccessError(429, str(exc), None, retry_after_header(exc.retry_after_s)) from None
        started = self.load.start()
        ended = False

        def end(tokens_used: int, ok: bool, prompt_counted: bool = True) -> None:
            nonlocal ended
            if ended:
                return
            ended = True
            lease.release(tokens_used if prompt_counted else tokens_used + prompt_bound)
            self.load.finish(started, ok)

        return end

    # -- admin ----------------------------------------------------------------------------------

    def require_admin(self, principal: Principal) -> None:
        """Admin-only reads (replica stats name every tenant's adapters): 403 otherwise."""
        if self.keys is None:
            raise AccessError(403, "admin endpoints need server.auth.enabled and an admin key")
        if not principal.admin:
            raise AccessError(403, "this API key is not an admin key")

    async def admin(
        self, principal: Principal, store: StoreConfig, collection: str, name: str, action: str,
        raw: bytes,
    ) -> dict[str, Any]:  # fmt: skip
        """Yank or unyank a name the admin key's tenant may see."""
        if self.keys is None:
            raise AccessError(403, "admin endpoints need server.auth.enabled and an admin key")
        if not principal.admin:
            raise AccessError(403, "this API key is not an admin key")
        if action not in ("yank", "unyank"):
            raise AccessError(404, f"unknown admin action {action!r}; use yank or unyank")
        try:
            body = YankBody.model_validate(json.loads(raw) if raw.strip() else {})
        except (ValueError, ValidationError) as exc:
            raise AccessError(400, f"invalid admin request body: {exc}") from None
        try:
            result = await asyncio.to_thread(
                set_yanked, store, principal.tenant, collection, name, body, action == "yank"
            )
        except AdminNotFound as exc:
            raise AccessError(404, str(exc), "name") from None
        except AdminFailed as exc:  # the store failed; the writes made were undone
            retry = 1 if exc.status == 503 else None
            raise AccessError(exc.status, exc.message, retry_after=retry) from None
        logger.info(
            "admin %s by key %s: %s %s %s", action, principal.key_id, result.kind, name,
            result.versions,
        )  # fmt: skip
        return result.model_dump()

    # -- runtime LoRA (vLLM's load/unload endpoints) --------------------------------------------

    async def lora(
        self, principal: Principal, cfg: Any, action: str, raw: bytes, root: Path
    ) -> dict[str, Any]:
        """Load (publish) or unload (yank) an adapter; admin keys only when auth is on."""
        runtime = cfg.server.runtime_lora
        if not runtime.enabled:
            raise AccessError(403, "runtime LoRA loading is disabled (server.runtime_lora)")
        if self.keys is not None and not principal.admin:
            raise AccessError(403, "this API key is not an admin key")
        model = LoadLoraBody if action == "load" else UnloadLoraBody
        try:
            body = model.model_validate(json.loads(raw) if raw.strip() else {})
        except (ValueError, ValidationError) as exc:
            raise AccessError(400, f"invalid request body: {exc}") from None
        tenant = principal.tenant if self.keys is not None else None
        try:
            if isinstance(body, LoadLoraBody):
                load_dir = (root / runtime.load_dir) if runtime.load_dir else None
                base = await asyncio.to_thread(_base_config, cfg)
                result = await asyncio.to_thread(load_lora, cfg.store, load_dir, base, tenant, body)
            else:
                result = await asyncio.to_thread(unload_lora, cfg.store, tenant, body)
        except LoraAdminError as exc:
            raise AccessError(exc.status, exc.message, exc.param) from None
        logger.info(
            "lora %s by key %s: %s %s", action, principal.key_id, result.name, result.versions
        )
        return result.model_dump()


def _base_config(cfg: Any) -> dict[str, Any] | None:
    """The served model's config.json, which the rulebook checks loaded adapters against."""
    try:
        return load_base_config(resolve_model_path(cfg.engine.model))
    except Exception:  # the model is not on this node: the replicas still check at load
        logger.warning("lora load: base model config unavailable; shapes checked at load only")
        return None
