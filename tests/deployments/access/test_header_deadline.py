"""The header deadline on a real uvicorn server (both of its HTTP parsers), as Serve builds its
router and proxy servers: a slowloris connection is answered 408 and closed, one that sends
nothing is closed, and neither a prompt request nor a slow body is cut by it."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from deployments.access import header_deadline
from tests.support import ports

DEADLINE_S = 0.6


async def _app(scope, receive, send) -> None:
    """Reads the whole body, then answers its length."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = json.dumps({"bytes": size}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(params=["h11", "httptools"])
def server(request) -> Iterator[int]:
    header_deadline.install(DEADLINE_S)
    port = ports.free_port()
    config = uvicorn.Config(
        _app, host="127.0.0.1", port=port, http=request.param, log_level="warning", lifespan="off"
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield port
    finally:
        srv.should_exit = True
        thread.join(10)
        header_deadline.uninstall()


def _read_all(conn: socket.socket, timeout: float = 5.0) -> bytes:
    conn.settimeout(timeout)
    chunks = []
    while True:
        data = conn.recv(65536)
        if not data:
            return b"".join(chunks)
        chunks.append(data)


def test_dribbled_headers_get_a_408_and_the_connection_closes(server: int) -> None:
    conn = socket.create_connection(("127.0.0.1", server))
    start = time.monotonic()
    for piece in (b"POST /v1/x HTTP/1.1\r\n", b"Host: a\r\n", b"X-Slow: 1\r\n"):
        conn.sendall(piece)
        time.sleep(DEADLINE_S / 4)
    answer = _read_all(conn)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b'"code": 408' in answer and b"request headers" in answer
    assert time.monotonic() - start < DEADLINE_S + 3


def test_a_silent_connection_is_closed(server: int) -> None:
    conn = socket.create_connection(("127.0.0.1", server))
    assert _read_all(conn).startswith(b"HTTP/1.1 408 ")


def test_prompt_requests_and_a_slow_body_pass(server: int) -> None:
    conn = socket.create_connection(("127.0.0.1", server))
    for turn in range(2):  # a kept-alive connection's next request gets its own deadline
        if turn:
            time.sleep(DEADLINE_S * 1.5)  # idle between requests: keep-alive's rule, not this one
        conn.sendall(b"POST /v1/x HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n\r\n")
        time.sleep(DEADLINE_S * 1.5)  # the body is slower than the header deadline
        conn.sendall(b"abcd")
        conn.settimeout(5)
        answer = b""
        while not answer.endswith(b"}"):  # head and body may come as two segments
            answer += conn.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"bytes": 4}'), answer
    conn.close()


def test_a_bad_deadline_is_refused() -> None:
    with pytest.raises(ValueError, match="> 0"):
        header_deadline.install(0)
