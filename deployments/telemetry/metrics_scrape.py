"""The API port's `GET /metrics`: Ray's metrics exporter of every live node, scraped in parallel,
merged and filtered by `exposition.merge`.

Scrapes are shared: callers within `CACHE_S` of the last scrape get its text, and concurrent
callers wait on one scrape, so a busy Prometheus (or an attacker) costs the exporters at most one
fetch per `CACHE_S`. A node that does not answer within `FETCH_TIMEOUT_S` is left out of that
scrape, and a caller waits at most `ANSWER_S` before it is given the previous scrape's text, so
/metrics answers within a second even under load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import httpx
import ray

from deployments.telemetry.exposition import merge

logger = logging.getLogger("ray.serve")

CACHE_S = 1.0
ANSWER_S = 0.8  # the longest a caller waits for a fresh scrape
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
    """Cached, bounded-time scrape of the cluster's exporters for the API port.

    A scrape runs as its own task: a caller waits for it at most `ANSWER_S`, then gets the
    previous text while the scrape finishes in the background and refreshes the cache. Node
    discovery (a GCS call) likewise runs beside, never inside, a caller's wait.
    """

    def __init__(
        self,
        private_names: Callable[[], Awaitable[frozenset[str]]],
        discover: Callable[[], list[str]] = exporter_urls,
    ) -> None:
        self._private_names = private_names
        self._discover = discover
        self._urls: list[str] = []
        self._urls_at = -NODES_TTL_S
        self._discovery: asyncio.Future[list[str]] | None = None
        self._text = ""
        self._at = -CACHE_S
        self._scrape_task: asyncio.Task[str] | None = None
        self._client = httpx.AsyncClient(timeout=FETCH_TIMEOUT_S)

    async def text(self) -> str:
        if time.monotonic() - self._at < CACHE_S:
            return self._text
        if self._scrape_task is None or self._scrape_task.done():
            self._scrape_task = asyncio.create_task(self._scrape())
        done, _ = await asyncio.wait({self._scrape_task}, timeout=ANSWER_S)
        if done:
            try:
                self._text = self._scrape_task.result()
                self._at = time.monotonic()
            except Exception as exc:  # keep serving the last good text
                logger.warning("metrics: scrape failed: %r", exc)
        return self._text

    async def _urls_now(self) -> list[str]:
        stale = time.monotonic() - self._urls_at >= NODES_TTL_S
        if stale and (self._discovery is None or self._discovery.done()):
            self._discovery = asyncio.ensure_future(asyncio.to_thread(self._discover))
        if not self._urls and self._discovery is not None:
            await asyncio.wait({self._discovery}, timeout=FETCH_TIMEOUT_S)
        if self._discovery is not None and self._discovery.done():
            try:
                self._urls = self._discovery.result()
                self._urls_at = time.monotonic()
            except Exception as exc:  # keep the last known nodes
                logger.warning("metrics: node list unavailable: %r", exc)
            self._discovery = None
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
        text = await asyncio.to_thread(merge, texts, private)
        self._text, self._at = text, time.monotonic()
        return text
