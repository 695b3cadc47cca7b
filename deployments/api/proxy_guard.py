"""Runs inside Ray Serve's HTTP proxy: a response the router never finished still ends cleanly.

When the router replica dies (SIGKILL, OOM, node loss) Ray's proxy stops relaying its messages and
returns: a stream already under way would be cut without its terminating chunk, and a response not
yet started would become a plain-text 500 (Ray's proxy sends nothing for a 500 and returns, and
uvicorn answers an app that returned without a response with `500 Internal Server Error`). This ASGI
middleware, which the proxy loads from `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` (see
`PROXY_ENV_VARS` in deployments/replica/serve_env.py), watches what the proxy sends; if the response
never completed it ends an event stream with the same error event and `[DONE]` a failed model
replica produces. A response not yet begun is sent once more through the proxy (which has marked
the dead router and picks another) when repeating it is harmless: reads, generation and
tokenizing, yank and unyank (the request body is kept as it streams in and replayed); otherwise,
or when that fails too, it is answered with an OpenAI-shaped JSON 503 and `Retry-After`. It imports
nothing of the project but the header deadline (uvicorn only): the proxy needs no more than
Starlette.

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

import asyncio
import hashlib
import json
import os
import re
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
# A response not begun when its router died (and not sent again, or sent again in vain).
NOT_ANSWERED = 503
NOT_ANSWERED_MESSAGE = "the router serving this request stopped before answering; retry the request"
MAYBE_DONE_MESSAGE = (
    "the router serving this request stopped before answering; the change may or may not have "
    "been made: check (GET /v1/models) before retrying"
)
# Requests sent once more on another router when theirs died before answering: repeating them
# changes nothing a first attempt may have done (a runtime load or unload would).
REPLAYABLE_POSTS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
)
REPLAYABLE_ADMIN = re.compile(r"^/v1/admin/[^/]+/[^/]+/(yank|unyank)$")
REPLAYS = 1
REPLAY_PAUSE_S = 0.2


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


def replayable(scope: Message) -> bool:
    """Whether sending this request again is harmless (see `REPLAYABLE_POSTS`)."""
    method, path = scope.get("method", "GET"), scope.get("path", "")
    if method in ("GET", "HEAD", "OPTIONS"):
        return True
    return method == "POST" and (path in REPLAYABLE_POSTS or bool(REPLAYABLE_ADMIN.match(path)))


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
        kept: list[Message] = []  # the request body as it came in, for a replay
        client = {"gone": False}

        async def keeping() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                kept.append(message)
            elif message["type"] == "http.disconnect":
                client["gone"] = True
            return message

        can_replay = replayable(scope)
        for attempt in range(REPLAYS + 1):
            again = can_replay and attempt < REPLAYS
            state = {"started": False, "sse": False, "done": False}
            try:
                await self.app(scope, _replaying(list(kept), keeping), _watching(state, send))
            except Exception:
                if state["started"] or client["gone"] or not again:
                    await self._finish(state, send, can_replay)
                    raise
            if state["started"] or client["gone"] or not again:
                await self._finish(state, send, can_replay)
                return
            await asyncio.sleep(REPLAY_PAUSE_S)  # nothing went out: send it once more

    @staticmethod
    async def _finish(state: dict[str, bool], send: Send, replayable: bool = True) -> None:
        if state["done"]:
            return
        if not state["started"]:
            message = NOT_ANSWERED_MESSAGE if replayable else MAYBE_DONE_MESSAGE
            await _send_json(send, NOT_ANSWERED, message, [(b"retry-after", b"1")])
        elif state["sse"]:
            event = json.dumps(error_body(ROUTER_LOST, LOST_MESSAGE))
            tail = f"data: {event}\n\ndata: [DONE]\n\n".encode()
            await send({"type": "http.response.body", "body": tail})
        # A started non-stream body is left cut: completing it would pass a truncated
        # JSON off as whole; the client sees the connection end before Content-Length.


def _replaying(replay: list[Message], rest: Callable[[], Awaitable[Message]]) -> Any:
    """A `receive` giving what an earlier attempt read, then the rest from the client."""

    async def receive() -> Message:
        return replay.pop(0) if replay else await rest()

    return receive


def _watching(state: dict[str, bool], send: Send) -> Send:
    """A `send` noting in `state` whether the response started, is an event stream, is done."""

    async def watched(message: Message) -> None:
        if message["type"] == "http.response.start":
            state["started"] = True
            for key, value in message.get("headers", ()):
                if key.lower() == b"content-type" and value.startswith(b"text/event-stream"):
                    state["sse"] = True
        elif message["type"] == "http.response.body" and not message.get("more_body"):
            state["done"] = True
        await send(message)

    return watched


def proxy_middlewares() -> list[Middleware]:
    """What Ray's proxy calls (by import path) for the middlewares to wrap its app with; it
    also bounds header arrival on the proxy's port (`MOLORA_HEADER_TIMEOUT_S`, default 10 s)."""
    header_deadline.install()
    return [Middleware(StreamGuard)]
