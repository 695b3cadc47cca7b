"""Reading an OpenAI-style server-sent-event stream (the benchmarks' clients share this)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx


async def sse_events(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """Each `data:` event of a streaming response as JSON, up to `[DONE]`."""
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return
        yield json.loads(line[6:])
