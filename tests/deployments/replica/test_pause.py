"""A model replica frozen for 20 s (SIGSTOP: as a long GC pause, CPU throttling or swap would)
is a delay, not an outage: streams in flight finish whole, the same replica keeps serving after
it resumes (Serve does not replace it) and requests sent after the pause all succeed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx

from tests.deployments.serve_helpers import replica_pid

PAUSE_S = 20.0
MESSAGES = [{"role": "user", "content": "Tell a story."}]


async def _stream(http: httpx.AsyncClient, tokens: int) -> tuple[int, str]:
    """(HTTP status, the text) of one stream; an error event fails the test."""
    body = {"model": "code", "messages": MESSAGES, "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    text = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            return resp.status_code, (await resp.aread()).decode()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text.extend(c["delta"].get("content") or "" for c in chunk["choices"])
    return 200, "".join(text)


async def test_a_20s_pause_delays_but_fails_nothing(app_url) -> None:
    """On the app the modules share (tests/deployments/conftest.py): it runs after them."""
    async with httpx.AsyncClient(base_url=app_url, timeout=180) as http:
        status, alone = await _stream(http, 48)
        assert status == 200
        before = (await http.get("/health")).json()["replica"]
        pid = replica_pid("ModelReplica")
        in_flight = [asyncio.create_task(_stream(http, 48)) for _ in range(4)]
        await asyncio.sleep(0.5)
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(PAUSE_S)
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
        results = await asyncio.gather(*in_flight)
        # After the pause: a request every second for 30 s, spanning Serve's health checks.
        after = []
        while time.monotonic() - resumed < 30:
            after.append(await _stream(http, 4))
            await asyncio.sleep(1.0)
        health = await http.get("/health")
    assert [s for s, _ in results] == [200] * 4 and {t for _, t in results} == {alone}
    assert all(s == 200 for s, _ in after), after
    assert health.status_code == 200 and health.json()["replica"] == before
    assert replica_pid("ModelReplica") == pid  # not replaced
