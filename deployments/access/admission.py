"""Admission before the body: an ASGI middleware that refuses a request from its headers alone.

A request's body may arrive slowly (or never): anything that waits for it holds a connection and
an ingress slot. So before one body byte is read, this layer authenticates the key, counts the
key's open requests (a per-key connection cap for every API path, and the key's
`max_concurrent` for generation paths) and refuses what is over with a 401/429 at once; then it
reads the body against a deadline and a byte cap (408/413). The principal it found rides in the
ASGI scope so the route does not verify the key again.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from deployments.access.auth import KeyRing, Principal, bearer_key
from deployments.config import AdmissionConfig, QuotaConfig
from deployments.protocol.openai_error import error_payload

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PRINCIPAL_SCOPE_KEY = "molora.principal"
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class Admission:
    """Per-key counters of open requests; one per ingress replica (event-loop only, no lock)."""

    def __init__(
        self, cfg: AdmissionConfig, keys: KeyRing | None, quotas: QuotaConfig, max_bytes: int
    ) -> None:
        self.cfg, self.keys, self.quotas, self.max_bytes = cfg, keys, quotas, max_bytes
        self.open: Counter[str] = Counter()
        self.generating: Counter[str] = Counter()

    def refuse(self, principal: Principal, generation: bool) -> tuple[int, str] | None:
        """Why this key may not open one more request now (status, message), or None."""
        if self.open[principal.key_id] >= self.cfg.max_connections_per_key:
            return 429, (
                f"too many open requests for this API key (limit "
                f"{self.cfg.max_connections_per_key} connections); retry when one finishes"
            )
        limit = self.quotas.limits_for(principal).max_concurrent
        if generation and limit is not None and self.generating[principal.key_id] >= limit:
            return 429, (
                f"too many concurrent requests for this API key (limit {limit}); retry when "
                "one finishes"
            )
        return None


async def _answer(send: Send, status: int, message: str, headers: dict[str, str]) -> None:
    body = json.dumps(error_payload(status, message, None)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


# BaseException: a route's broad `except Exception` must not turn these into a 5xx.
class _BodyTooSlow(BaseException):
    pass


class _BodyTooLarge(BaseException):
    pass


class AdmissionMiddleware:
    """Reads `scope["app"].state.admission` (set by the ingress); passes through until it is."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = getattr(scope.get("app"), "state", None)
        admission: Admission | None = getattr(state, "admission", None)
        path = scope.get("path", "")
        if scope["type"] != "http" or admission is None or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > admission.max_bytes:
            await _answer(send, 413, f"request body exceeds {admission.max_bytes} bytes", {})
            return
        principal: Principal | None = None
        if admission.keys is not None:
            key = bearer_key(headers.get("authorization"))
            principal = await admission.keys.verify_async(key) if key else None
            if principal is None:
                why = (
                    "invalid API key"
                    if key
                    else "missing API key: send 'Authorization: Bearer <key>'"
                )
                await _answer(send, 401, why, {"WWW-Authenticate": 'Bearer realm="molora"'})
                return
            generation = scope.get("method") == "POST" and path in GENERATION_PATHS
            refusal = admission.refuse(principal, generation)
            if refusal is not None:
                await _answer(send, refusal[0], refusal[1], {"Retry-After": "1"})
                return
            scope[PRINCIPAL_SCOPE_KEY] = principal
        await self._run(scope, receive, send, admission, principal)

    async def _run(
        self, scope: Scope, receive: Receive, send: Send, admission: Admission,
        principal: Principal | None,
    ) -> None:  # fmt: skip
        key = principal.key_id if principal is not None else None
        generation = scope.get("method") == "POST" and scope.get("path") in GENERATION_PATHS
        if key is not None:
            admission.open[key] += 1
            admission.generating[key] += generation
        deadline = time.monotonic() + admission.cfg.body_timeout_s
        body_done = scope.get("method") in ("GET", "HEAD")
        received = 0
        started = False

        async def guarded_receive() -> Message:
            nonlocal body_done, received
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise _BodyTooSlow from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > admission.max_bytes:
                    raise _BodyTooLarge
                body_done = not message.get("more_body", False)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, guarded_receive, tracking_send)
        except (_BodyTooSlow, _BodyTooLarge) as exc:
            if started:
                raise
            if isinstance(exc, _BodyTooSlow):
                message = (
                    f"the request body did not arrive within {admission.cfg.body_timeout_s:g} s"
                )
                await _answer(send, 408, message, {"Connection": "close"})
            else:
                message = f"request body exceeds {admission.max_bytes} bytes"
                await _answer(send, 413, message, {"Connection": "close"})
        finally:
            if key is not None:
                admission.open[key] -= 1
                admission.generating[key] -= generation
                if admission.open[key] <= 0:
                    del admission.open[key]
                if admission.generating[key] <= 0:
                    del admission.generating[key]
