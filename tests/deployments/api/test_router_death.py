"""The router replica (Serve's ingress) SIGKILLed mid-stream: Ray's HTTP proxy stops relaying,
and the proxy's stream guard ends every stream it was carrying with an error event and `[DONE]`
(never a cut chunked body); a request the dead router had not answered yet is sent once more by
the guard and completes on the restarted router; no answer is Ray's plain-text 500; Serve
restarts the router and requests succeed again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from deployments.api.proxy_guard import LOST_MESSAGE, NOT_ANSWERED, ROUTER_LOST
from tests.deployments.serve_helpers import replica_pid, serving, shipped_args

MESSAGES = [{"role": "user", "content": "Tell a long story."}]
STREAM = {"model": "code", "messages": MESSAGES, "max_tokens": 900, "ignore_eos": True,
          "stream": True}  # fmt: skip


@pytest.fixture(scope="module")
def router_app(ray_cluster, tiny_assets):
    args = shipped_args(tiny_assets, engine={"max_num_seqs": 4, "max_model_len": 1024})
    yield from serving(ray_cluster, args, replicas=1, max_ongoing=32)


async def _open(http: httpx.AsyncClient) -> tuple[object, httpx.Response, object, list[str]]:
    ctx = http.stream("POST", "/v1/chat/completions", json=STREAM)
    resp = await ctx.__aenter__()
    assert resp.status_code == 200
    lines = resp.aiter_lines()
    seen: list[str] = []
    while not seen:
        line = await anext(lines)
        if line.startswith("data: "):
            seen.append(line[6:])
    return ctx, resp, lines, seen


async def test_router_killed_mid_stream_ends_streams_with_an_error_event(router_app) -> None:
    async with httpx.AsyncClient(base_url=router_app, timeout=120) as http:
        pid = replica_pid("Router")
        streams = [await _open(http) for _ in range(3)]
        # Not streamed: nothing of its answer has gone out when the router dies.
        whole = asyncio.create_task(
            http.post("/v1/chat/completions", json={**STREAM, "stream": False, "max_tokens": 300})
        )
        await asyncio.sleep(1.0)
        assert not whole.done()
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        for ctx, _resp, lines, seen in streams:
            async for line in lines:  # a cut chunked body would raise RemoteProtocolError here
                if line.startswith("data: "):
                    seen.append(line[6:])
            await ctx.__aexit__(None, None, None)
            assert seen[-1] == "[DONE]", seen[-3:]
            error = json.loads(seen[-2])["error"]
            assert error == {"message": LOST_MESSAGE, "type": "server_error", "param": None,
                             "code": ROUTER_LOST}  # fmt: skip
            assert all("error" not in json.loads(s) for s in seen[:-2])
        # Until Serve has a router again every answer is JSON (a 502 from the guard, or Ray's
        # own 503/408), then requests succeed.
        answers = []
        while time.monotonic() - killed < 120:
            resp = await http.post(
                "/v1/chat/completions",
                json={"model": "code", "messages": MESSAGES, "max_tokens": 2},
                timeout=30,
            )
            answers.append(resp.status_code)
            if resp.status_code == 200:
                break
            assert resp.status_code != 500, resp.text
            if resp.status_code in (ROUTER_LOST, NOT_ANSWERED):
                assert resp.headers["content-type"].startswith("application/json"), resp.text
                assert resp.json()["error"]["code"] == resp.status_code
            await asyncio.sleep(0.5)
        print(f"router back after {time.monotonic() - killed:.1f} s; answers {answers}")
        assert answers[-1] == 200, answers
        # Replayed by the guard once Serve had a router again: answered in full.
        resp = await whole
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 300
