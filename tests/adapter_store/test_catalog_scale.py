"""A store's size costs a request nothing: the router keeps one registry across catalog reloads
(a PEFT folder is derived once while its files are unchanged), reloads in the background (a
request never waits on the store once a catalog is loaded), and builds a caller's resolver once
per catalog load and tenant."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from adapter_store.backends import peft_folder
from adapter_store.backends.derived_memo import MEMO_DIR as DERIVED_DIR
from deployments.access.auth import ANONYMOUS
from deployments.access.gate import Access
from deployments.catalog.model_names import AdapterEntry, Catalog, CatalogCache
from deployments.catalog.store import CatalogLoader
from deployments.config import ServeConfig, StoreConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def peft_dir(adapters_dir: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "peft"
    for i in range(6):
        shutil.copytree(adapters_dir / ("alpha" if i % 2 else "beta"), folder / f"n{i}")
    return folder


@pytest.fixture
def derived(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the folders derived (read and hashed) from now on, in order."""
    names: list[str] = []
    real = peft_folder.PeftFolderBackend._derive

    def counting(self, name, stats):  # type: ignore[no-untyped-def]
        names.append(name)
        return real(self, name, stats)

    monkeypatch.setattr(peft_folder.PeftFolderBackend, "_derive", counting)
    return names


def test_a_reload_derives_only_changed_folders(
    peft_dir: Path, adapters_dir: Path, derived: list[str]
) -> None:
    load = CatalogLoader(StoreConfig(url=f"peft:{peft_dir}"))
    first = load()
    assert sorted(first.adapters) == [f"n{i}" for i in range(6)] and len(derived) == 6
    second = load()
    assert second.adapters == first.adapters and len(derived) == 6  # nothing hashed again
    # An edited folder is a new version, derived again alone; a new folder appears.
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(adapters_dir / "beta" / f, peft_dir / "n1" / f)
    shutil.copytree(adapters_dir / "alpha", peft_dir / "n6")
    load._registry.backend._listed.clear()  # type: ignore[union-attr]  # past the stats TTL
    third = load()
    assert sorted(derived[6:]) == ["n1", "n6"]
    assert third.adapters["n1"].latest != first.adapters["n1"].latest
    assert third.adapters["n0"] == first.adapters["n0"]


async def test_requests_never_wait_on_a_reload() -> None:
    gate = asyncio.Event()
    loads = 0

    async def load() -> Catalog:
        nonlocal loads
        loads += 1
        if loads > 1:
            await gate.wait()  # a slow store: the second load hangs until released
        return Catalog(adapters={f"a{loads}": AdapterEntry(name=f"a{loads}")})

    cache = CatalogCache(load, ttl_s=0.05)
    try:
        first = await cache.get()
        assert list(first.adapters) == ["a1"]
        await asyncio.sleep(0.2)  # the background reload has started and hangs
        assert loads == 2
        got = await asyncio.wait_for(cache.get(), timeout=0.1)
        assert got is first  # served at once from the last good catalog
        gate.set()
        for _ in range(50):
            await asyncio.sleep(0.02)
            if "a2" in (await cache.get()).adapters:
                break
        assert list((await cache.get()).adapters) == ["a2"]
    finally:
        cache.close()


async def test_a_failed_reload_keeps_the_last_good_catalog() -> None:
    calls = 0

    async def load() -> Catalog:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise OSError("store down")
        return Catalog(adapters={"a": AdapterEntry(name="a")})

    cache = CatalogCache(load, ttl_s=0.02)
    try:
        first = await cache.get()
        await asyncio.sleep(0.15)
        assert calls > 2 and await cache.get() is first
        with pytest.raises(OSError):
            await cache.refresh()  # a change is never acknowledged on a stale catalog
    finally:
        cache.close()


def test_one_resolver_per_catalog_load_and_tenant(monkeypatch) -> None:
    from deployments.access import gate

    views = 0
    real = gate.visible_catalog

    def counting(catalog: Catalog, tenant: str | None) -> Catalog:
        nonlocal views
        views += 1
        return real(catalog, tenant)

    monkeypatch.setattr(gate, "visible_catalog", counting)
    cfg = ServeConfig.from_args({"served_model_name": "base"})
    access = Access(cfg.server, 4, ROOT)
    catalog = Catalog(
        adapters={
            f"n{i}": AdapterEntry(name=f"n{i}", versions=("v",), latest="v") for i in range(10_000)
        }
    )
    first = access.resolver(ANONYMOUS, catalog, cfg)
    for _ in range(100):
        assert access.resolver(ANONYMOUS, catalog, cfg) is first
        assert first.resolve("n42").route.adapter == "n42@v"
    assert views == 1
    reloaded = Catalog(adapters=dict(catalog.adapters))
    assert access.resolver(ANONYMOUS, reloaded, cfg) is not first and views == 2


async def test_the_price_of_a_load_is_known() -> None:
    """The background reload keeps to its share of a core: it needs the price of the last
    load."""

    async def slow_load() -> Catalog:
        await asyncio.sleep(0.05)
        return Catalog()

    cache = CatalogCache(slow_load, ttl_s=60)
    try:
        await cache.get()
        assert cache.load_s >= 0.05
        await cache.refresh()
        assert 0.05 <= cache.load_s < 5
    finally:
        cache.close()


async def test_a_slow_listing_is_reloaded_less_often() -> None:
    """A store whose listing takes a second (10,000 folders) is not re-listed every `ttl_s`:
    the background reload keeps to its share of a core."""
    loads = 0

    async def load() -> Catalog:
        nonlocal loads
        loads += 1
        await asyncio.sleep(0.15)
        return Catalog(adapters={"a": AdapterEntry(name="a")})

    cache = CatalogCache(load, ttl_s=0.01, max_share=0.5)
    try:
        await cache.get()
        assert cache.reload_period() >= 0.3  # 0.15 s a load at most half of the time
        await asyncio.sleep(0.7)
        assert loads <= 4  # a load every 0.15 s would make 5 or more
    finally:
        cache.close()
    quick = CatalogCache(load, ttl_s=10.0, max_share=0.25)
    quick.load_s = 0.15
    assert quick.reload_period() == 10.0  # a cheap listing keeps its period
    small = CatalogCache(load, ttl_s=1.0, max_share=0.02)
    small.load_s = 0.05
    assert small.reload_period() == 1.0  # a load under the floor never stretches it
    # With the loader's CPU time known, a slow store's wait stretches nothing.
    waiting = CatalogCache(load, ttl_s=0.01, max_share=0.25, load_cpu_s=lambda: 0.001)
    waiting.load_s = 5.0
    assert waiting.reload_period() == 0.01


def test_a_loader_knows_the_cpu_its_last_load_took(peft_dir: Path) -> None:
    load = CatalogLoader(StoreConfig(url=f"peft:{peft_dir}"))
    load()
    assert 0 < load.cpu_s < 60


def test_a_restarted_loader_reads_only_changed_folders(
    peft_dir: Path, adapters_dir: Path, tmp_path: Path, derived: list[str]
) -> None:
    """Derived manifests outlive the process in the cache dir: a router that restarts (a
    rolling update) lists the store and reads only what changed since."""
    (peft_dir / "bad").mkdir()
    (peft_dir / "bad" / "adapter_config.json").write_text("{}")
    cfg = StoreConfig(url=f"peft:{peft_dir}", cache_dir=str(tmp_path / "cache"))
    first = CatalogLoader(cfg)()
    assert len(derived) == 7 and "bad" not in first.adapters
    again = CatalogLoader(cfg)()  # a new process: nothing is read again
    assert again.adapters == first.adapters and len(derived) == 7
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(adapters_dir / "beta" / f, peft_dir / "n1" / f)
    memo = next((tmp_path / "cache" / DERIVED_DIR).iterdir())
    with memo.open("a") as out:
        out.write('{"name": "n2", "stamp": [["adap')  # a line torn by a crash is a miss
    third = CatalogLoader(cfg)()
    assert derived[7:] == ["n1"]
    assert third.adapters["n1"].latest != first.adapters["n1"].latest
    assert third.adapters["n0"] == first.adapters["n0"]
