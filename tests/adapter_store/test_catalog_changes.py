"""A catalog change is in force on every router when its call returns, and costs each router a
read of the names it touched, not a reload of the store (local and S3 store).

Two routers' catalog caches, loaders and watches over one store, with the real epoch deployment
object between them (in-process, behind a handle's `.remote` shape); changes are made by the
admin API's own store writes (yank, runtime load). Also: a full reload that began before a
change cannot undo it when it finishes after, and a write whose call never bumped the epoch (its
client went away) still reaches every router within about a second."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from adapter_store import Registry
from deployments.catalog import epoch as epoch_mod
from deployments.catalog.admin import YankBody, set_yanked
from deployments.catalog.journal import JOURNAL, Journal
from deployments.catalog.lora_admin import LoadLoraBody, load_lora
from deployments.catalog.model_names import AdapterEntry, Catalog, CatalogCache
from deployments.catalog.store import CatalogLoader
from deployments.catalog.watch import CatalogWatch
from deployments.config import StoreConfig

N = 12  # adapters in the store: a full reload lists every one of them


class Local:
    """A Serve handle's call shape (`handle.method.remote(...)`, awaited) over a local object."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(remote=getattr(self._target, name))


class CountingLoader(CatalogLoader):
    """The real loader, counting full loads and single-name reads."""

    def __init__(self, cfg: StoreConfig) -> None:
        super().__init__(cfg)
        self.full = 0
        self.names: list[tuple[str, str]] = []

    def __call__(self) -> Catalog:
        self.full += 1
        return super().__call__()

    def entries(self, keys):  # type: ignore[no-untyped-def]
        self.names.extend(keys)
        return super().entries(keys)


class Router:
    """One router's catalog parts. A process holds one router, whose watch bumps the writes the
    process's journal holds: here only the first router's watch has the real journal."""

    def __init__(self, cfg: StoreConfig, epoch: Any, name: str, journal: Journal) -> None:
        self.loader = CountingLoader(cfg)
        self.cache = CatalogCache(lambda: asyncio.to_thread(self.loader), ttl_s=3600)
        self.watch = CatalogWatch(self.cache, Local(epoch), name, self.loader, journal)

    def adapters(self) -> dict[str, AdapterEntry]:
        """What a request admitted now would resolve against (no reload is triggered)."""
        assert self.cache._catalog is not None
        return self.cache._catalog.adapters

    def close(self) -> None:
        assert self.watch._task is not None
        self.watch._task.cancel()
        self.cache.close()


async def _routers(cfg: StoreConfig, n: int = 2) -> tuple[Any, list[Router]]:
    epoch = epoch_mod.CatalogEpoch.func_or_class()
    epoch.started -= 60  # not a restarted epoch: the routers below are all there are
    epoch.is_dead = lambda name, namespace: None
    JOURNAL.take()  # other tests' writes in this process are not this test's changes
    routers = [Router(cfg, epoch, f"r{i}", JOURNAL if i == 0 else Journal()) for i in range(n)]
    for _ in range(200):
        if all(r.watch.known >= 0 for r in routers):
            break
        await asyncio.sleep(0.02)
    assert all(r.loader.full == 1 for r in routers)  # each router's one full load, at start
    return epoch, routers


def _publish(registry: Registry, alpha: Path, base_config: dict) -> None:
    for i in range(N):
        registry.publish_adapter(alpha, f"n{i}", "v1", base_config=base_config)


async def test_a_change_is_in_force_on_every_router_when_it_returns(
    registry: Registry, store_url: str, alpha: Path, base_config: dict
) -> None:
    _publish(registry, alpha, base_config)
    cfg = StoreConfig(url=store_url)
    epoch, routers = await _routers(cfg)
    a, b = routers
    try:
        assert "n3" in b.adapters()
        # A yank through the admin API's store write, then the change call of router a.
        await asyncio.to_thread(set_yanked, cfg, None, "adapters", "n3", YankBody(), True)
        started = time.monotonic()
        headers = await a.watch.changed()
        took = time.monotonic() - started
        assert headers == {}  # every router confirmed
        assert "n3" not in a.adapters() and "n3" not in b.adapters()  # in force, both routers
        assert took < 5, took
        # Each router re-read the one name; nobody reloaded the store for it.
        assert set(b.loader.names) == {("adapter", "n3")} and b.loader.full == 1
        assert a.loader.full == 1

        # A runtime load (a new name) and an unyank at once, from the same router: each call
        # returns with its own change in force everywhere, whichever bump carried it.
        load = LoadLoraBody(lora_name="fresh", lora_path="store:n1")

        async def runtime_load() -> dict[str, str]:
            await asyncio.to_thread(load_lora, cfg, None, base_config, None, load)
            return await a.watch.changed()

        async def unyank() -> dict[str, str]:
            body = YankBody(version="v1")
            await asyncio.to_thread(set_yanked, cfg, None, "adapters", "n3", body, False)
            return await a.watch.changed()

        assert await asyncio.gather(runtime_load(), unyank()) == [{}, {}]
        for r in routers:
            assert r.adapters()["fresh"].versions == ("v1",)
            assert r.adapters()["n3"].versions == ("v1",)
            assert r.loader.full == 1
        assert epoch.epoch >= 2
    finally:
        for r in routers:
            r.close()


async def test_a_write_whose_call_never_bumped_still_reaches_every_router(
    registry: Registry, store_url: str, alpha: Path, base_config: dict
) -> None:
    """The admin call's client went away after the store write (the request was cancelled
    before it bumped): the watch bumps the orphaned write itself."""
    _publish(registry, alpha, base_config)
    cfg = StoreConfig(url=store_url)
    _, routers = await _routers(cfg)
    try:
        await asyncio.to_thread(set_yanked, cfg, None, "adapters", "n5", YankBody(), True)
        started = time.monotonic()
        while time.monotonic() - started < 10:
            if all("n5" not in r.adapters() for r in routers):
                break
            await asyncio.sleep(0.05)
        took = time.monotonic() - started
        assert all("n5" not in r.adapters() for r in routers)
        assert took < 5, took  # the watch's orphan bump (ORPHAN_S), not store.refresh_s
        assert all(r.loader.full == 1 for r in routers)
    finally:
        for r in routers:
            r.close()


async def test_a_full_reload_begun_before_a_change_cannot_undo_it() -> None:
    """The background reload lists the store, the change lands and is applied alone, then the
    reload finishes with what it listed before: the change stays."""
    listed = asyncio.Event()
    release = asyncio.Event()
    loads = 0
    old = Catalog(adapters={"n0": AdapterEntry(name="n0", versions=("v1",), latest="v1")})

    async def load() -> Catalog:
        nonlocal loads
        loads += 1
        if loads == 1:
            return old
        listed.set()
        await release.wait()  # listed before the change; returns after it was applied
        return old

    cache = CatalogCache(load, ttl_s=3600)
    try:
        await cache.get()
        reload = asyncio.create_task(cache.refresh())
        await listed.wait()
        await cache.apply(time.monotonic(), {("adapter", "n0"): None})  # yanked, read alone
        assert "n0" not in (await cache.get()).adapters
        release.set()
        await reload
        assert "n0" not in (await cache.get()).adapters
        # A reload begun after the change installs whatever it read, that name included.
        await cache.refresh()
        assert "n0" in (await cache.get()).adapters
    finally:
        cache.close()
