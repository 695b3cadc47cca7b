"""A deadline for a request's line and headers on the HTTP servers Ray Serve starts.

uvicorn closes an idle keep-alive connection, and the admission middleware bounds a body's
arrival, but nothing bounds the request line and headers: a client that opens connections and
dribbles header bytes (slowloris) holds a socket and a file descriptor each for as long as it
likes, and enough of them starve every other client of the process. `install` patches uvicorn's
two HTTP protocol classes in this process (the router's own port and Serve's proxy build their
servers from them) so that a connection whose request headers are not complete within the
deadline of its opening, or of the first byte of its next request, is answered 408 and closed.
A request whose headers have arrived is never cut here.
"""

from __future__ import annotations

import json
import os
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

ENV = "MOLORA_HEADER_TIMEOUT_S"
DEFAULT_S = 10.0
_PROTOCOLS = (H11Protocol, HttpToolsProtocol)
_state: dict[str, Any] = {"timeout_s": None, "originals": {}}


def timeout_response(timeout_s: float) -> bytes:
    """The raw 408 a connection gets when its headers miss the deadline (OpenAI error shape)."""
    message = f"the request headers did not arrive within {timeout_s:g} s"
    body = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": 408}}
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def _expire(protocol: Any) -> None:
    protocol._molora_deadline = None
    transport = protocol.transport
    if transport is None or transport.is_closing():
        return
    transport.write(timeout_response(_state["timeout_s"]))
    transport.close()


def _arm(protocol: Any) -> None:
    if getattr(protocol, "_molora_deadline", None) is None:
        loop = protocol.loop
        protocol._molora_deadline = loop.call_later(_state["timeout_s"], _expire, protocol)


def _disarm(protocol: Any) -> None:
    handle = getattr(protocol, "_molora_deadline", None)
    if handle is not None:
        handle.cancel()
        protocol._molora_deadline = None


def _patched(cls: type) -> dict[str, Any]:
    made, received, lost = cls.connection_made, cls.data_received, cls.connection_lost

    def connection_made(self: Any, transport: Any) -> None:
        made(self, transport)
        _arm(self)

    def data_received(self: Any, data: bytes) -> None:
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            _arm(self)  # bytes of a request whose headers have yet to arrive
        received(self, data)
        if self.cycle is not None and self.cycle is not cycle:
            _disarm(self)  # a new request's headers are complete

    def connection_lost(self: Any, exc: Exception | None) -> None:
        _disarm(self)
        lost(self, exc)

    return {
        "connection_made": connection_made,
        "data_received": data_received,
        "connection_lost": connection_lost,
    }


def install(timeout_s: float | None = None) -> float:
    """Bound header arrival in every uvicorn server of this process; returns the deadline in s.

    `timeout_s` None reads `MOLORA_HEADER_TIMEOUT_S` (default 10 s). Installing twice keeps one
    patch and the latest deadline."""
    if timeout_s is None:
        timeout_s = float(os.environ.get(ENV) or DEFAULT_S)
    if timeout_s <= 0:
        raise ValueError(f"the header deadline must be > 0 s, got {timeout_s}")
    _state["timeout_s"] = timeout_s
    originals = _state["originals"]
    for cls in _PROTOCOLS:
        if cls in originals:
            continue
        originals[cls] = {
            name: getattr(cls, name)
            for name in ("connection_made", "data_received", "connection_lost")
        }
        for name, method in _patched(cls).items():
            setattr(cls, name, method)
    return timeout_s


def uninstall() -> None:
    """Restore uvicorn's own protocol methods (tests)."""
    for cls, methods in _state["originals"].items():
        for name, method in methods.items():
            setattr(cls, name, method)
    _state["originals"] = {}
