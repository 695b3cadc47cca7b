"""An unknown name costs the router that name's own store read, not a catalog reload: a folder
written behind the router's back is found by the first request naming it, and random names
are read once per absence window and within a share of the time."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from deployments.access.tenancy import store_keys
from deployments.catalog.model_names import Catalog, CatalogCache, ModelNotFound, Resolver
from deployments.catalog.name_lookup import NameLookup
from deployments.catalog.store import CatalogLoader
from deployments.config import ServeConfig, StoreConfig
from tests.adapter_store.store_helpers import make_peft_adapter

CFG = ServeConfig.from_args({"served_model_name": "base"})


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("peft-src")
    make_peft_adapter(root / "a", r=4, targets=["q_proj", "v_proj"], seed=1)
    return root / "a"


class Counted:
    """The real catalog loader, counting its full loads."""

    def __init__(self, loader: CatalogLoader) -> None:
        self.loader, self.loads = loader, 0

    async def __call__(self) -> Catalog:
        self.loads += 1
        return await asyncio.to_thread(self.loader)


@pytest.fixture
async def store(adapter: Path, tmp_path: Path) -> AsyncIterator[tuple[Path, Counted, CatalogCache]]:
    folder = tmp_path / "peft"
    for i in range(3):
        shutil.copytree(adapter, folder / f"n{i}")
    counted = Counted(CatalogLoader(StoreConfig(url=f"peft:{folder}")))
    cache = CatalogCache(counted, ttl_s=3600)
    yield folder, counted, cache
    cache.close()


def _missing(catalog: Catalog, model: str) -> tuple:
    with pytest.raises(ModelNotFound) as info:
        Resolver(CFG, catalog).resolve(model)
    return info.value.names


async def test_a_folder_written_behind_the_routers_back_is_found_alone(
    store: tuple[Path, Counted, CatalogCache], adapter: Path
) -> None:
    folder, counted, cache = store
    lookup = NameLookup(cache, counted.loader.entries, absent_ttl_s=60)
    seen = await cache.get()
    shutil.copytree(adapter, folder / "late")
    names = _missing(seen, "late")
    assert names == (("adapter", "late"), ("composition", "late"))
    assert await lookup.find(store_keys(names, None), seen)
    found = await cache.get()
    assert Resolver(CFG, found).resolve("late").route.adapter.startswith("late@")
    assert sorted(found.adapters) == ["late", "n0", "n1", "n2"]
    assert counted.loads == 1 and lookup.reads == 1  # no full reload
    # In a mix, only the name that is missing is read.
    shutil.copytree(adapter, folder / "later")
    assert _missing(found, "n0:0.5+later:0.5") == (("adapter", "later"),)


async def test_random_names_are_read_once_and_within_a_share_of_the_time(
    store: tuple[Path, Counted, CatalogCache],
) -> None:
    _, counted, cache = store
    lookup = NameLookup(cache, counted.loader.entries, absent_ttl_s=60, burst_s=1e-9)
    seen = await cache.get()
    keys = store_keys(_missing(seen, "nothing"), None)
    assert not await lookup.find(keys, seen)
    assert lookup.reads == 1 and await cache.get() is seen  # resolvers are not rebuilt
    assert not await lookup.find(keys, seen)
    assert lookup.reads == 1  # known absent: not read again within the window
    other = store_keys(_missing(seen, "other"), None)
    assert not await lookup.find(other, seen)
    assert lookup.reads == 1  # the first read spent the (tiny) budget
    assert counted.loads == 1


async def test_malformed_and_hidden_names_read_nothing(
    store: tuple[Path, Counted, CatalogCache],
) -> None:
    _, _, cache = store
    seen = await cache.get()
    assert _missing(seen, "../etc") == ()
    cfg = ServeConfig.from_args({"served_model_name": "base", "expose": {"mixes": True}})
    with pytest.raises(ModelNotFound) as info:
        Resolver(cfg, seen).resolve("base:ghost")
    assert info.value.names == (("adapter", "ghost"), ("composition", "ghost"))


def test_a_tenant_means_its_own_name_first() -> None:
    names = (("adapter", "x"), ("adapter", "acme~y"))
    assert store_keys(names, "acme") == [
        ("adapter", "acme~x"),
        ("adapter", "x"),
        ("adapter", "acme~y"),
    ]
    assert store_keys(names, None) == list(names)
