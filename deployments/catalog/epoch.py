"""The catalog epoch: a push path that makes a store change reach every router before the
change's HTTP call returns.

One tiny deployment holds a counter and a log of what each epoch changed. Every router
long-polls `watch` with the epoch it has applied; a router that changed the store (load, unload,
yank, unyank) calls `bump` with the store names it touched, which wakes every watcher with those
names (each re-reads only them, deployments/catalog/watch.py) and waits until each live router
has come back with the new epoch.

Liveness is a heartbeat: a long poll returns at least every `WATCH_S`, so a live router calls
again within about that. A router silent for `DEAD_CHECK_S` is looked up in Ray: when its actor
is dead it is forgotten at once (a killed router costs a change about two seconds, not the
timeout). A router silent for `LIVE_S` that Ray does not report dead is no longer waited for,
but it is still named in the answer (`unconfirmed`) until it has been silent for `ALIVE_S`: a
router that is only stalled (SIGSTOP, a long GC pause) may serve its old catalog when it wakes,
so the caller must hear of it. A live router that does not confirm within `timeout_s` is named
too; the change is made either way and such a router converges within `store.refresh_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel
from ray import serve

from deployments.catalog.journal import ChangedName

logger = logging.getLogger("ray.serve")

# A long poll returns at least this often: the routers' heartbeat.
WATCH_S = 1.0
# Silent this long (a missed heartbeat): ask Ray whether the router's actor is dead.
DEAD_CHECK_S = 1.5
# A router is waited for while its last call is this recent (a heartbeat, a reply's transit and
# one incremental apply, with room for an event loop and threads starved of CPU).
LIVE_S = 5.0
# A silent router is named as unconfirmed this long, unless Ray reports its actor dead.
ALIVE_S = 35.0
# How often a waiting bump re-checks who is live, and how often silent routers are looked up.
POLL_S = 0.1
REAP_S = 0.5
# Epochs remembered with their names; a router further behind reloads the whole catalog.
LOG_MAX = 4096


class BumpResult(BaseModel):
    epoch: int
    routers: int  # live routers when the bump returned
    unconfirmed: list[str]  # routers that may still serve the catalog before this epoch
    waited_s: float = 0.0


class WatchReply(BaseModel):
    """What a router must apply to reach `epoch` of epoch deployment `instance`."""

    instance: str
    epoch: int
    changes: list[ChangedName] | None  # None: reload the whole catalog


@dataclass
class _Seen:
    known: int  # the epoch this router has applied (-1: none of this instance's)
    at: float  # monotonic time of its last call
    actor: str | None = None  # its Ray actor's name and namespace, to ask Ray if it died
    namespace: str | None = None


def ray_actor_dead(name: str, namespace: str | None) -> bool | None:
    """Whether Ray says the named actor is gone (its name is released when it dies); None when
    Ray cannot be asked."""
    import ray

    if not ray.is_initialized():
        return None
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:  # "Failed to look up actor": no live actor holds the name
        return True
    except Exception:  # the GCS unreachable, say: not known to be dead
        return None
    return False


@serve.deployment(
    name="CatalogEpoch",
    num_replicas=1,
    max_ongoing_requests=4096,
    ray_actor_options={"num_cpus": 0},
)
class CatalogEpoch:
    """The epoch counter, its change log and the routers' acknowledgements (one replica by
    design: a restarted one has a new `instance`, and every router then reloads in full)."""

    def __init__(self) -> None:
        self.instance = uuid.uuid4().hex
        self.epoch = 0
        self.started = time.monotonic()
        self._log: deque[tuple[int, list[ChangedName] | None]] = deque(maxlen=LOG_MAX)
        self._changed = asyncio.Event()
        self._acked = asyncio.Event()
        self._seen: dict[str, _Seen] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._dead_votes: dict[str, int] = {}  # router -> Ray's "dead" answers in a row
        # Swappable for tests that run without Ray.
        self.is_dead: Callable[[str, str | None], bool | None] = ray_actor_dead

    # -- routers' side ------------------------------------------------------------------------

    async def watch(
        self,
        router: str,
        known: int,
        instance: str = "",
        actor: str | None = None,
        namespace: str | None = None,
    ) -> dict[str, object]:
        """Record that `router` has applied `known`; return what it must apply next once the
        epoch moves past it (or after `WATCH_S`, its heartbeat)."""
        self._start_reaper()
        if instance != self.instance:
            known = -1  # nothing of this instance applied yet: a full reload follows
        self._seen[router] = _Seen(known, time.monotonic(), actor, namespace)
        self._dead_votes.pop(router, None)
        self._wake_bumps()
        if known == self.epoch:
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), WATCH_S)
        return self._reply(known).model_dump()

    def _reply(self, known: int) -> WatchReply:
        if known == self.epoch:
            return WatchReply(instance=self.instance, epoch=self.epoch, changes=[])
        first = self._log[0][0] if self._log else self.epoch + 1
        if known < 0 or known > self.epoch or first > known + 1:
            return WatchReply(instance=self.instance, epoch=self.epoch, changes=None)
        names: dict[tuple[str, str], ChangedName] = {}
        for epoch, changes in self._log:
            if epoch <= known:
                continue
            if changes is None:
                return WatchReply(instance=self.instance, epoch=self.epoch, changes=None)
            for c in changes:
                names[c.key] = c
        return WatchReply(instance=self.instance, epoch=self.epoch, changes=list(names.values()))

    async def current(self) -> int:
        return self.epoch

    # -- liveness -------------------------------------------------------------------------------

    def _wake_bumps(self) -> None:
        self._acked.set()
        self._acked = asyncio.Event()

    def _awaited(self, epoch: int, now: float) -> list[str]:
        """Live routers that have not applied `epoch` yet."""
        return sorted(r for r, s in self._seen.items() if s.known < epoch and now - s.at < LIVE_S)

    def _named(self, epoch: int, now: float) -> list[str]:
        """Routers that may still serve an older catalog: live laggards and silent ones not
        known to be dead."""
        return sorted(r for r, s in self._seen.items() if s.known < epoch and now - s.at < ALIVE_S)

    def _start_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(REAP_S)
            try:
                await self.reap()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.warning("catalog epoch: checking silent routers failed", exc_info=True)

    async def reap(self) -> list[str]:
        """Forget routers silent past `DEAD_CHECK_S` whose actors Ray reports dead, and those
        silent past `ALIVE_S`; returns the routers forgotten."""
        now = time.monotonic()
        gone = [r for r, s in self._seen.items() if now - s.at >= ALIVE_S]
        for router, seen in list(self._seen.items()):
            if router in gone or now - seen.at < DEAD_CHECK_S or seen.actor is None:
                continue
            try:
                dead = await asyncio.wait_for(
                    asyncio.to_thread(self.is_dead, seen.actor, seen.namespace), 5.0
                )
            except TimeoutError:
                dead = None
            # Twice in a row: one lookup is never enough to stop waiting for a router.
            votes = self._dead_votes[router] = self._dead_votes.get(router, 0) + 1 if dead else 0
            if votes >= 2:
                gone.append(router)
        for router in gone:
            # A router that called again meanwhile is alive after all.
            seen = self._seen.get(router)
            if seen is not None and time.monotonic() - seen.at >= DEAD_CHECK_S:
                del self._seen[router]
                self._dead_votes.pop(router, None)
                logger.info("catalog epoch: router %s is gone; no longer waited for", router)
        if gone:
            self._wake_bumps()
        return gone

    # -- a change -------------------------------------------------------------------------------

    async def bump(
        self, changes: list[dict[str, object]] | None = None, timeout_s: float = 10.0
    ) -> dict[str, object]:
        """Advance the epoch with the store names a change touched (None: everything) and wait
        until every live router has applied it, at most `timeout_s`."""
        self._start_reaper()
        names = None if changes is None else [ChangedName.model_validate(c) for c in changes]
        self.epoch += 1
        epoch = self.epoch
        self._log.append((epoch, names))
        self._changed.set()
        self._changed = asyncio.Event()
        start = time.monotonic()
        deadline = start + timeout_s
        while True:
            now = time.monotonic()
            # A restarted epoch waits until every live router has had time to call in.
            if not self._awaited(epoch, now) and now - self.started >= LIVE_S:
                break
            left = deadline - now
            if left <= 0:
                break
            acked = self._acked
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(acked.wait(), min(left, POLL_S))
        now = time.monotonic()
        if now - start > 1.0:
            logger.info("catalog epoch %d: waited %.3f s for routers", epoch, now - start)
        unconfirmed = self._named(epoch, now)
        if now - self.started < LIVE_S:
            unconfirmed.append("routers-not-yet-heard-from")
        live = sum(1 for s in self._seen.values() if now - s.at < LIVE_S)
        return BumpResult(
            epoch=epoch, routers=live, unconfirmed=unconfirmed, waited_s=round(now - start, 3)
        ).model_dump()
