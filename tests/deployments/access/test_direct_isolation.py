"""The abuse and isolation suite on the shipped path: the router serving HTTP itself (Serve's
direct ingress), with no Serve proxy in front of it.

One app for the module, configured as the union of what the proxy-path modules deploy (API keys,
per-key quotas, the admission caps, a one-sequence engine so a queued request shows when another
is dropped); their own tests then run unchanged against the router's port: auth (401), quotas
(429 with Retry-After), body size (413), slow bodies and idle keep-alives (408, the endpoint not
frozen), bad JSON (400 in the OpenAI shape) and disconnect = abort. Flooding and overload are
checked here: every answer is a whole completion or a 429/503 with Retry-After, and another
tenant's requests complete.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from tests.deployments.access import test_attacks as attacks
from tests.deployments.access import test_security as security
from tests.deployments.access import test_tenant_isolation as isolation
from tests.deployments.api import test_direct_ingress as shipped
from tests.deployments.serve_helpers import deployed, keyed_server, tiny_args
from tests.support.local_ray import ROUTER_POOL, router_url

FLOOD_TOKENS = 120
HEADER_TIMEOUT_S = 2.0
SLOW_HEADERS = 200
QUEUE = 8  # engine slots: one running, this many waiting
BAD_BODIES = ("not-an-object", "bad-utf8", "deep-json", "temperature-nan", "stream-yes",
              "lone-surrogate", "max-tokens-string")  # fmt: skip


@pytest.fixture(scope="module")
def direct(ray_cluster, tiny_assets, tmp_path_factory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("direct-isolation")
    holders = dict.fromkeys(security.HOLDERS + isolation.HOLDERS)  # the union, in order
    keys, server = keyed_server(root, list(holders), {**security.QUOTAS, **isolation.QUOTAS})
    server["admission"] = {
        "body_timeout_s": isolation.BODY_TIMEOUT_S,
        "header_timeout_s": HEADER_TIMEOUT_S,
        "max_connections_per_key": isolation.CONNECTION_CAP,
    }
    args = tiny_args(tiny_assets, seqs=1, queue=QUEUE, model_len=1100, max_tokens=8, server=server)
    with deployed(ray_cluster["url"], args, replicas=1, max_ongoing=64):
        url = router_url(ray_cluster["router_port"])
        yield {"url": url, "keys": keys}


def _headers(direct: dict[str, Any], who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {direct['keys'][who]}"}


def test_the_url_is_the_routers_own_server(ray_cluster, direct) -> None:
    port = urlparse(direct["url"]).port
    low = ray_cluster["router_port"]
    assert port != urlparse(ray_cluster["url"]).port and low <= port < low + ROUTER_POOL
    assert httpx.get(f"{direct['url']}/-/healthz", timeout=30).status_code == 200


def test_missing_or_bad_key_is_401(direct) -> None:
    security.test_missing_or_bad_key_is_401(direct)


async def test_request_quota_holds_under_32_concurrent_clients(direct) -> None:
    await security.test_request_quota_holds_under_32_concurrent_clients(direct)


async def test_concurrency_quota_holds_under_32_concurrent_streams(direct) -> None:
    await security.test_concurrency_quota_holds_under_32_concurrent_streams(direct)


def test_token_quota_charges_and_settles(direct) -> None:
    security.test_token_quota_charges_and_settles(direct)


def _whole_or_retry_later(resp: httpx.Response) -> int:
    """A completion with every token asked for, or a 429/503 in the OpenAI shape with a
    Retry-After: nothing cut, nothing lost silently."""
    if resp.status_code == 200:
        assert resp.json()["usage"]["completion_tokens"] == FLOOD_TOKENS
    else:
        security._error(resp, resp.status_code)
        assert resp.status_code in (429, 503)
        assert 1 <= int(resp.headers["retry-after"]) <= 60
    return resp.status_code


async def _flood(direct: dict[str, Any], who: str, n: int, others: int = 0) -> tuple[list, list]:
    """`n` concurrent completions of `who`; `others` of acme once the flood is in."""
    body = {"model": "math", "prompt": "go", "max_tokens": FLOOD_TOKENS, "ignore_eos": True}
    limits = httpx.Limits(max_connections=n + others)
    async with httpx.AsyncClient(base_url=direct["url"], timeout=300, limits=limits) as http:
        flood = [
            asyncio.create_task(
                http.post("/v1/completions", json=body, headers=_headers(direct, who))
            )
            for _ in range(n)
        ]
        await asyncio.sleep(0.5)
        acme = [
            http.post("/v1/completions", json=body, headers=_headers(direct, "acme"))
            for _ in range(others)
        ]
        return await asyncio.gather(*flood), await asyncio.gather(*acme)


async def test_a_flooding_tenant_is_held_to_its_quota_and_others_complete(direct) -> None:
    flood, acme = await _flood(direct, "evil", 24, others=3)
    statuses = [_whole_or_retry_later(r) for r in flood]
    assert statuses.count(200) >= 4 and statuses.count(429) >= 16, statuses
    assert [_whole_or_retry_later(r) for r in acme] == [200] * 3


async def test_overload_answers_retry_after_and_loses_nothing(direct) -> None:
    """More than the engine holds (one running, QUEUE waiting) from a key without quotas: what
    fits completes whole, the rest is told when to come back, and the engine serves after."""
    flood, _ = await _flood(direct, "evil_wide", isolation.CONNECTION_CAP)
    statuses = [_whole_or_retry_later(r) for r in flood]
    assert statuses.count(200) >= 1 + QUEUE and len(statuses) > statuses.count(200), statuses
    assert security._chat(direct, "acme", "math").status_code == 200


async def test_oversized_body_refused_from_its_headers(direct) -> None:
    await isolation.test_oversized_body_refused_from_its_headers(direct)


async def test_an_oversized_chunked_body_is_cut_at_the_cap(direct) -> None:
    """No Content-Length to refuse from: the byte cap (1 MiB) cuts the body as it arrives."""

    async def body() -> Any:
        for _ in range(18):  # 1.125 MiB
            yield b" " * 65536

    async with httpx.AsyncClient(base_url=direct["url"], timeout=60) as http:
        resp = await http.post(
            "/v1/chat/completions", content=body(), headers=_headers(direct, "globex")
        )
    attacks._assert_openai_error(resp, 413, "exceeds")


async def test_slow_bodies_do_not_freeze_the_endpoint(direct) -> None:
    await isolation.test_slow_bodies_do_not_freeze_the_endpoint(direct)


async def test_reconnecting_slow_bodies_and_idle_keep_alives(direct) -> None:
    await isolation.test_reconnecting_slow_bodies_and_idle_keep_alives(direct)


async def test_dribbled_headers_get_a_408_and_others_are_served(direct) -> None:
    """Slowloris on the router's port: connections that never finish their headers are answered
    408 and closed by the deadline, while another tenant's completion goes through."""
    port = urlparse(direct["url"]).port

    async def dribble() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: molora\r\n")
            for _ in range(int(HEADER_TIMEOUT_S * 4)):
                await asyncio.sleep(0.5)
                if reader.at_eof():
                    break
                writer.write(b"X-Slow: 1\r\n")
            return await asyncio.wait_for(reader.read(), HEADER_TIMEOUT_S * 4)
        finally:
            writer.close()

    slow = [asyncio.create_task(dribble()) for _ in range(SLOW_HEADERS)]
    await asyncio.sleep(0.5)
    async with httpx.AsyncClient(base_url=direct["url"], timeout=60) as http:
        resp = await http.post(
            "/v1/chat/completions",
            json={"model": "math", "messages": [{"role": "user", "content": "hi"}]},
            headers=_headers(direct, "globex"),
        )
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"]
    answers = await asyncio.gather(*slow)
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), {a[:40] for a in answers}


async def test_bad_json_is_a_400_in_the_openai_shape(direct) -> None:
    async with httpx.AsyncClient(
        base_url=direct["url"], headers=_headers(direct, "globex"), timeout=60
    ) as http:
        for name in BAD_BODIES:
            await attacks._fire(http, name)


async def test_a_client_disconnect_aborts_the_request(direct) -> None:
    served = shipped.Served(None, urlparse(direct["url"]).port, 0, direct["keys"]["globex"])
    await shipped.test_a_client_disconnect_aborts_the_request(served)
