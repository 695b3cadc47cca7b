"""A streaming chat client for the endpoint benchmarks: one request's timings, one cell's stats."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.sse import sse_events
from benchmarks.workload import NEW_TOKENS, PROMPTS


@dataclass
class Sample:
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    text: str = ""
    error: str | None = None


def request_body(
    model: str,
    prompt: str,
    route: dict[str, Any] | None,
    max_tokens: int = NEW_TOKENS,
    ignore_eos: bool = True,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if route is not None:
        body["molora"] = {"route": route}
    return body


async def one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Sample:
    s = Sample()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                s.error = f"{resp.status_code}: {(await resp.aread())[:200]!r}"
                return s
            async for event in sse_events(resp):
                for choice in event.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        now = time.perf_counter()
                        if s.ttft is None:
                            s.ttft = now - start
                        else:
                            s.itl.append(now - last)
                        last = now
                        s.text += content
                if event.get("usage"):
                    s.tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        s.error = f"{type(exc).__name__}: {exc}"
    return s


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


async def run_cell(port: int, models: list[tuple[str, dict | None]], conc: int, n: int) -> dict:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    limits = httpx.Limits(max_connections=conc + 4, max_keepalive_connections=conc + 4)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        sem = asyncio.Semaphore(conc)

        async def task(i: int) -> Sample:
            model, route = models[i % len(models)]
            async with sem:
                return await one(client, url, request_body(model, PROMPTS[i % 8], route))

        start = time.perf_counter()
        samples = await asyncio.gather(*(task(i) for i in range(n)))
        seconds = time.perf_counter() - start
    tokens = sum(s.tokens for s in samples)
    ttfts = [s.ttft for s in samples if s.ttft is not None]
    itls = [x for s in samples for x in s.itl]
    return {
        "concurrency": conc,
        "requests": n,
        "errors": [s.error for s in samples if s.error][:3],
        "completion_tokens": tokens,
        "seconds": round(seconds, 2),
        "tok_per_s": round(tokens / seconds, 1),
        "ttft_p50_ms": pct(ttfts, 0.5),
        "ttft_p99_ms": pct(ttfts, 0.99),
        "itl_p50_ms": pct(itls, 0.5),
        "itl_p99_ms": pct(itls, 0.99),
    }
