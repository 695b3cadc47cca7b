"""The catalog epoch: a push path that makes a store change reach every router before the
change's HTTP call returns.

One tiny deployment holds a counter. Every router long-polls `watch` with the epoch it has
loaded; a router that changed the store (load, unload, yank, unyank) calls `bump`, which wakes
every watcher and waits until each router seen recently has reloaded its catalog and come back
with the new epoch. A router that does not acknowledge within `timeout_s` is reported back
(the change is still made; that router converges within `store.refresh_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from pydantic import BaseModel
from ray import serve

# A router counts as alive while its last watch call is this recent (watch calls return at
# least every `WATCH_S`, so a live router is never older than that plus one reload).
WATCH_S = 20.0
ALIVE_S = WATCH_S + 15.0


class BumpResult(BaseModel):
    epoch: int
    routers: int
    unconfirmed: list[str]


@serve.deployment(
    name="CatalogEpoch",
    num_replicas=1,
    max_ongoing_requests=4096,
    ray_actor_options={"num_cpus": 0},
)
class CatalogEpoch:
    """The epoch counter and the routers' acknowledgements (one replica by design)."""

    def __init__(self) -> None:
        self.epoch = 0
        self._changed = asyncio.Event()
        self._acked = asyncio.Event()
        self._seen: dict[str, tuple[int, float]] = {}  # router -> (epoch loaded, when)

    async def watch(self, router: str, known: int) -> int:
        """Record that `router` has loaded `known`; return the epoch once it differs (or after
        `WATCH_S`, so the router stays counted as alive)."""
        self._seen[router] = (known, time.monotonic())
        self._acked.set()
        self._acked = asyncio.Event()
        if known == self.epoch:
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), WATCH_S)
        return self.epoch

    async def current(self) -> int:
        return self.epoch

    def _laggards(self, epoch: int) -> list[str]:
        now = time.monotonic()
        return sorted(
            r for r, (known, at) in self._seen.items() if known < epoch and now - at < ALIVE_S
        )

    async def bump(self, timeout_s: float = 10.0) -> dict[str, object]:
        """Advance the epoch and wait until every live router has reloaded past it."""
        self.epoch += 1
        epoch = self.epoch
        self._changed.set()
        self._changed = asyncio.Event()
        deadline = time.monotonic() + timeout_s
        while self._laggards(epoch):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            acked = self._acked
            try:
                await asyncio.wait_for(acked.wait(), left)
            except TimeoutError:
                break
        self._seen = {r: s for r, s in self._seen.items() if time.monotonic() - s[1] < ALIVE_S}
        return BumpResult(
            epoch=epoch, routers=len(self._seen), unconfirmed=self._laggards(epoch)
        ).model_dump()
