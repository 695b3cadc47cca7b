"""The API port's `GET /metrics`: Ray's metrics exporter of every live node, scraped in parallel,
merged and filtered by `exposition.merge`.

Scrapes are shared: callers within `CACHE_S` of the last scrape get its text, and concurrent
callers wait on one scrape, so a busy Prometheus (or an attacker) costs the exporters at most one
fetch per `CACHE_S`. A node that does not answer within `FETCH_TIMEOUT_S` is left out of that
scrape rather than delaying it, so /metrics answers within about a second even under load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import httpx
import ray

from deployments.ops.exposition import merge

logger = logging.getLogger("ray.serve")

CACHE_S = 1.0
FETCH_TIMEOUT_S = 0.8
NODES_TTL_S = 30.0


def exporter_urls() -> list[str]:
    """The metrics exporter of every live Ray node (from the GCS: a blocking call)."""
    urls = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if node.get("Alive") and port:
            urls.append(f"http://{node['NodeManagerAddress']}:{port}/metrics")
    return sorted(urls)


class MetricsScraper:
    """Cached, bounded-time scrape of the cluster's exporters for the API port."""

    def __init__(
        self,
        private_names: Callable[[], Awaitable[frozenset[str]]],
        discover: Callable[[], list[str]] = exporter_urls,
    ) -> None:
        self._private_names = private_names
        self._discover = discover
        self._urls: list[str] = []
        self._urls_at = -NODES_TTL_S
        self._text = ""
        self._at = -CACHE_S
        self._lock = asyncio.Lock()
        self._client = httpx.AsyncClient(timeout=FETCH_TIMEOUT_S)

    async def text(self) -> str:
        if time.monotonic() - self._at < CACHE_S:
            return self._text
        async with self._lock:
            if time.monotonic() - self._at < CACHE_S:
                return self._text
            self._text = await self._scrape()
            self._at = time.monotonic()
            return self._text

    async def _urls_now(self) -> list[str]:
        if time.monotonic() - self._urls_at >= NODES_TTL_S or not self._urls:
            try:
                self._urls = await asyncio.wait_for(asyncio.to_thread(self._discover), 0.5)
                self._urls_at = time.monotonic()
            except Exception as exc:  # keep the last known nodes
                logger.warning("metrics: node list unavailable: %r", exc)
        return self._urls

    async def _fetch(self, url: str) -> str:
        try:
            resp = await self._client.get(url)
            resp.raise_for_status()
            return resp.text
        except Exception as exc:
            logger.debug("metrics: %s left out of this scrape: %r", url, exc)
            return ""

    async def _scrape(self) -> str:
        texts = await asyncio.gather(*(self._fetch(u) for u in await self._urls_now()))
        private = await self._private_names()
        return await asyncio.to_thread(merge, texts, private)
