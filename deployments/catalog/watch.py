"""A router's side of the catalog epoch (deployments/catalog/epoch.py): apply every bump, and
after a change this router made, bump with the names it touched and wait for every router.

Applying a bump re-reads only the store names it carries (one listing each) and installs them
in the catalog cache; a full reload happens only when the epoch cannot say what changed (this
router is new, fell more than the epoch's log behind, or the epoch deployment restarted).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from deployments.catalog.epoch import BumpResult, WatchReply
from deployments.catalog.journal import JOURNAL, ChangedName, Journal
from deployments.catalog.model_names import AdapterEntry, CatalogCache, CompositionEntry, NameKey

logger = logging.getLogger("ray.serve")

RETRY_S = 1.0
BUMP_TIMEOUT_S = 10.0
# A write whose HTTP call never bumped (the caller went away mid-call) is bumped this late.
ORPHAN_S = 1.0
UNCONFIRMED_HEADER = "X-Molora-Catalog-Unconfirmed"
SLOW_APPLY_S = 0.5  # an apply slower than this is logged (the bumps wait on it)


class NameReader(Protocol):
    """Reads single names from the store (deployments/catalog/store.py `CatalogLoader`)."""

    def entries(
        self, keys: list[NameKey]
    ) -> dict[NameKey, AdapterEntry | CompositionEntry | None]: ...


def _self_actor() -> tuple[str | None, str | None, str | None]:
    """(Serve replica id, Ray actor name, namespace) of this process, when it is a replica; the
    name and namespace are ones under which Ray finds this very actor (the epoch asks Ray about
    it the same way), else None. A replica's job namespace is its Serve controller's creator's,
    often not "serve" where Serve keeps the replica actors' names, so both are tried."""
    try:
        import ray
        from ray import serve

        if not ray.is_initialized():  # `get_runtime_context` would start a local Ray
            return None, None, None
        ctx = ray.get_runtime_context()
        replica = serve.get_replica_context().replica_id.unique_id
        name = ctx.get_actor_name()
    except Exception:  # not a Serve replica (unit use)
        return None, None, None
    for namespace in dict.fromkeys((ctx.namespace, "serve")):
        try:
            ray.get_actor(name, namespace=namespace)
        except Exception:
            continue
        return replica, name, namespace
    logger.warning("catalog watch: Ray does not find this router by name; no death checks")
    return replica, None, None


class CatalogWatch:
    """Long-polls the epoch deployment; without one (unit use) only this router reloads."""

    def __init__(
        self,
        catalog: CatalogCache,
        handle: Any | None,
        router_id: str,
        reader: NameReader | None = None,
        journal: Journal = JOURNAL,
    ) -> None:
        self.catalog = catalog
        self.handle = handle
        replica, self.actor, self.namespace = _self_actor()
        self.router_id = replica or router_id  # Serve's replica id: what operators see
        self._reader = reader
        self.journal = journal
        self.known = -1
        self.instance = ""
        self._bump_lock = asyncio.Lock()
        self._covered = 0  # the journal's sequence number the last bump carried
        self._covered_headers: dict[str, str] = {}
        self._orphans: asyncio.Task[Any] | None = None
        self._task = (
            asyncio.get_running_loop().create_task(self._watch()) if handle is not None else None
        )

    # -- applying -------------------------------------------------------------------------------

    async def apply(self, changes: list[ChangedName] | None) -> None:
        """Bring the catalog up to date with `changes`: re-read those names only (None: reload
        everything). Raises if the store cannot be read."""
        reader = self._reader
        if changes is None or reader is None:
            await self.catalog.refresh()
            return
        if not changes:
            return
        keys = list(dict.fromkeys(c.key for c in changes))
        started = time.monotonic()
        entries = await asyncio.to_thread(reader.entries, keys)
        await self.catalog.apply(started, entries)

    async def _watch(self) -> None:
        while True:
            try:
                raw = await self.handle.watch.remote(
                    self.router_id, self.known, self.instance, self.actor, self.namespace
                )
                reply = WatchReply.model_validate(raw)
                full = reply.instance != self.instance
                started = time.monotonic()
                await self.apply(None if full else reply.changes)
                if (took := time.monotonic() - started) > SLOW_APPLY_S:
                    logger.info("catalog epoch %d applied in %.3f s", reply.epoch, took)
                self.instance, self.known = reply.instance, reply.epoch
                if self.journal.age() > ORPHAN_S and (
                    self._orphans is None or self._orphans.done()
                ):
                    # Never awaited here: the bump waits for this very loop's next call.
                    self._orphans = asyncio.get_running_loop().create_task(self.changed())
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.warning("catalog epoch watch failed; retrying", exc_info=True)
                await asyncio.sleep(RETRY_S)

    # -- a change made here -----------------------------------------------------------------------

    async def changed(self) -> dict[str, str]:
        """This router changed the store: bump the epoch with the names written and wait until
        every live router (this one too, through its own watch) has applied them. Returns
        response headers naming the routers that did not confirm (none: the change is in force
        on every router).

        Every write this process made before the call is covered: a bump takes all pending
        names, and a call whose names another call's bump took waits for that bump."""
        want = self.journal.seq  # the caller's own write is recorded by now
        t0 = time.monotonic()
        async with self._bump_lock:
            if self._covered >= want:
                return dict(self._covered_headers)
            t1 = time.monotonic()
            seq, names = self.journal.take()
            # This router is one the bump waits for: its own watch loop applies the names
            # before confirming, so only a failed bump (or no epoch) needs an apply here.
            headers = await self._bump(names)
            if self.handle is None or headers.get(UNCONFIRMED_HEADER) == "all":
                try:
                    await self.apply(names)
                except Exception:
                    logger.warning("catalog update after a change failed", exc_info=True)
            self._covered, self._covered_headers = seq, headers
            logger.info(
                "catalog change of %s: queued %.3f s, confirmed %.3f s",
                "everything" if names is None else [n.name for n in names],
                t1 - t0, time.monotonic() - t1,
            )  # fmt: skip
            return dict(headers)

    async def _bump(self, names: list[ChangedName] | None) -> dict[str, str]:
        if self.handle is None:
            return {}  # no epoch (unit use): this router, updated by the caller, is all there is
        payload = None if names is None else [n.model_dump() for n in names]
        try:
            raw = await self.handle.bump.remote(payload, BUMP_TIMEOUT_S)
            result = BumpResult.model_validate(raw)
        except Exception as exc:
            logger.warning("catalog epoch bump failed: %s", exc)
            self.journal.put_back(names)  # the next bump carries them again
            return {UNCONFIRMED_HEADER: "all"}
        if result.unconfirmed:
            logger.warning(
                "routers %s did not confirm catalog epoch %d", result.unconfirmed, result.epoch
            )
            return {UNCONFIRMED_HEADER: ",".join(result.unconfirmed)}
        return {}
