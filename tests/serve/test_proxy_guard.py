"""The proxy's middleware on its own, over a Starlette app: the per-key cap of open requests
(the router-death half runs against real Ray in test_router_death.py)."""

from __future__ import annotations

import asyncio

import httpx
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from deployments.api.proxy_guard import CAP_ENV, StreamGuard


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
