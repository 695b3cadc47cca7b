"""A router's side of the catalog epoch (deployments/catalog/epoch.py): reload on every bump,
and after a change this router made, bump and wait for every router to reload."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from deployments.catalog.model_names import CatalogCache

logger = logging.getLogger("ray.serve")

RETRY_S = 1.0
BUMP_TIMEOUT_S = 10.0
UNCONFIRMED_HEADER = "X-Molora-Catalog-Unconfirmed"


class CatalogWatch:
    """Long-polls the epoch deployment; without one (unit use) only this router reloads."""

    def __init__(self, catalog: CatalogCache, handle: Any | None, router_id: str) -> None:
        self.catalog = catalog
        self.handle = handle
        self.router_id = router_id
        self.known = -1
        self._task = (
            asyncio.get_running_loop().create_task(self._watch()) if handle is not None else None
        )

    async def _watch(self) -> None:
        while True:
            try:
                epoch = await self.handle.watch.remote(self.router_id, self.known)
                if epoch != self.known:
                    await self.catalog.refresh()
                    self.known = epoch
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.warning("catalog epoch watch failed; retrying", exc_info=True)
                await asyncio.sleep(RETRY_S)

    async def changed(self) -> dict[str, str]:
        """This router changed the store: reload here, then make every router reload before
        the caller hears back. Returns response headers naming routers that did not confirm."""
        try:
            await self.catalog.refresh()
        except Exception:
            logger.warning("catalog reload after a change failed", exc_info=True)
        if self.handle is None:
            return {}
        try:
            result = await self.handle.bump.remote(BUMP_TIMEOUT_S)
        except Exception as exc:
            logger.warning("catalog epoch bump failed: %s", exc)
            return {UNCONFIRMED_HEADER: "all"}
        unconfirmed = result.get("unconfirmed") or []
        if unconfirmed:
            logger.warning("routers %s did not confirm the catalog change", unconfirmed)
            return {UNCONFIRMED_HEADER: str(len(unconfirmed))}
        return {}
