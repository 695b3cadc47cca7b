"""The proxy's middleware on its own, over a Starlette app: the per-key cap of open requests
(the router-death half runs against real Ray in test_router_death.py)."""

from __future__ import annotations

import asyncio

import httpx
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from deployments.api.proxy_guard import CAP_ENV, NOT_ANSWERED, StreamGuard


async def test_a_keys_requests_over_the_cap_are_refused_in_the_proxy(monkeypatch) -> None:
    release = asyncio.Event()

    async def slow(_request) -> JSONResponse:
        await release.wait()
        return JSONResponse({"ok": True})

    monkeypatch.setenv(CAP_ENV, "2")
    guard = StreamGuard(Starlette(routes=[Route("/v1/x", slow)]))
    transport = httpx.ASGITransport(app=guard)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as http:

        def call(token: str | None):
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            return asyncio.create_task(http.get("/v1/x", headers=headers))

        held = [call("flood"), call("flood")]
        await asyncio.sleep(0.05)
        refused = await call("flood")
        others = [call("other"), call(None), call(None), call(None)]
        await asyncio.sleep(0.05)
        release.set()
        answers = [r.status_code for r in await asyncio.gather(*held, *others)]
        again = await call("flood")
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert answers == [200] * 6 and again.status_code == 200
    assert guard.open == {}


async def test_the_cap_is_off_by_default(monkeypatch) -> None:
    monkeypatch.delenv(CAP_ENV, raising=False)
    assert StreamGuard(Starlette()).cap == 0


def _dying_proxy(deaths: int, calls: list[bytes]):
    """Ray's proxy as the guard sees it when the router dies before answering: it reads the
    request body, then returns without sending a byte (`deaths` times); then a live router
    echoes the body."""

    async def app(scope, receive, send) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        calls.append(body)
        if len(calls) <= deaths:
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"echo:" + body})

    return app


async def test_a_request_whose_router_died_before_answering_is_sent_once_more() -> None:
    answers, calls = [], []
    for path, body in (("/v1/chat/completions", b'{"model": "m"}'), ("/v1/admin/c/n/yank", b"{}")):
        seen: list[bytes] = []
        transport = httpx.ASGITransport(app=StreamGuard(_dying_proxy(1, seen)))
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as http:
            answers.append(await http.post(path, content=body))
        calls.append(seen)
    assert [(r.status_code, r.content) for r in answers] == [
        (200, b'echo:{"model": "m"}'),
        (200, b"echo:{}"),
    ]
    # Each attempt read the whole body: the second one from what the guard kept.
    assert calls == [[b'{"model": "m"}', b'{"model": "m"}'], [b"{}", b"{}"]]


async def test_a_router_lost_twice_or_on_a_change_that_may_have_landed_is_a_json_503() -> None:
    calls: list[bytes] = []
    transport = httpx.ASGITransport(app=StreamGuard(_dying_proxy(10, calls)))
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as http:
        twice = await http.post("/v1/completions", content=b"{}")
        assert len(calls) == 2
        load = await http.post("/v1/load_lora_adapter", content=b"{}")
        assert len(calls) == 3  # a runtime load is never sent twice: it may have landed
    for resp in (twice, load):
        assert resp.status_code == NOT_ANSWERED and resp.headers["retry-after"] == "1"
        assert resp.headers["content-type"] == "application/json"
        assert resp.json()["error"]["code"] == NOT_ANSWERED
    assert "may or may not have been made" in load.json()["error"]["message"]
