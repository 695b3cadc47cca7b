"""Runs inside Ray Serve's HTTP proxy: a response the router never finished still ends cleanly.

When the router replica dies (SIGKILL, OOM, node loss) Ray's proxy stops relaying its messages and
returns: a stream already under way would be cut without its terminating chunk, and a response not
yet started would become a plain-text 500. This ASGI middleware, which the proxy loads from
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` (see `PROXY_ENV_VARS` in
deployments/replica/serve_env.py), watches what the proxy sends; if the response never completed it
ends an event stream with the same error event and `[DONE]` a failed model replica produces, and
answers a response not yet begun with an OpenAI-shaped JSON error. It imports nothing of the project
but the header deadline (uvicorn only): the proxy needs no more than Starlette.

With `MOLORA_PROXY_MAX_OPEN_PER_KEY` set (> 0; for servers with auth on, at most the router's
`server.admission.max_connections_per_key`) it also refuses, in the proxy itself, a request
whose bearer token already has that many requests open through this proxy: a flood of one key's
connections is answered 429 without the per-request cost of a call to the router (which still
applies every real check). Off by default: with auth off every client may send the same dummy
token.

With Serve's direct ingress (the router serving HTTP itself) there is no proxy in the path and
the router's death closes the TCP connection; clients detect it by the missing `[DONE]`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.middleware import Middleware

from deployments.access import header_deadline

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]

CAP_ENV = "MOLORA_PROXY_MAX_OPEN_PER_KEY"
ROUTER_LOST = 502
LOST_MESSAGE = (
    "the router serving this request stopped before the response was complete; retry the request"
)


def error_body(status: int, message: str) -> dict[str, Any]:
    """The OpenAI error shape (as `deployments.protocol.openai_error.error_payload`)."""
    kinds = {429: "rate_limit_error", 503: "service_unavailable"}
    kind = kinds.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def _token_of(scope: Message) -> bytes | None:
    """A digest of the request's Authorization header (the raw value; nothing is verified)."""
    for key, value in scope.get("headers", ()):
        if key.lower() == b"authorization":
            return hashlib.sha256(value).digest()[:16]
    return None


async def _send_json(send: Send, status: int, message: str, extra: list | None = None) -> None:
    body = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send(
        {"type": "http.response.start", "status": status, "headers": headers + (extra or [])}
    )
    await send({"type": "http.response.body", "body": body})


class StreamGuard:
    """Completes any HTTP response its app left unfinished, and caps one bearer token's open
    requests (see the module docstring)."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app
        self.cap = int(os.environ.get(CAP_ENV) or 0)
        self.open: Counter[bytes] = Counter()

    async def __call__(self, scope: Message, receive: Any, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        token = _token_of(scope) if self.cap > 0 else None
        if token is None:
            await self._guarded(scope, receive, send)
            return
        if self.open[token] >= self.cap:
            message = (
                f"too many open requests for this API key ({self.cap} connections); retry when "
                "one finishes"
            )
            await _send_json(send, 429, message, [(b"retry-after", b"1")])
            return
        self.open[token] += 1
        try:
            await self._guarded(scope, receive, send)
        finally:
            self.open[token] -= 1
            if self.open[token] <= 0:
                del self.open[token]

    async def _guarded(self, scope: Message, receive: Any, send: Send) -> None:
        state = {"started": False, "sse": False, "done": False}

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
                for key, value in message.get("headers", ()):
                    if key.lower() == b"content-type" and value.startswith(b"text/event-stream"):
                        state["sse"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                state["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            await self._finish(state, send)
            raise
        await self._finish(state, send)

    @staticmethod
    async def _finish(state: dict[str, bool], send: Send) -> None:
        if state["done"]:
            return
        if not state["started"]:
            await _send_json(send, ROUTER_LOST, LOST_MESSAGE)
        elif state["sse"]:
            event = json.dumps(error_body(ROUTER_LOST, LOST_MESSAGE))
            tail = f"data: {event}\n\ndata: [DONE]\n\n".encode()
            await send({"type": "http.response.body", "body": tail})
        # A started non-stream body is left cut: completing it would pass a truncated
        # JSON off as whole; the client sees the connection end before Content-Length.


def proxy_middlewares() -> list[Middleware]:
    """What Ray's proxy calls (by import path) for the middlewares to wrap its app with; it
    also bounds header arrival on the proxy's port (`MOLORA_HEADER_TIMEOUT_S`, default 10 s)."""
    header_deadline.install()
    return [Middleware(StreamGuard)]
