"""The disk tier: counted hits, misses, loads and evictions; pinned adapters survive LRU."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapter_store import AdapterStoreSource, NotFoundError, open_registry
from tests.adapter_store.store_helpers import make_synthetic_adapter


def test_disk_tier_counts_and_keeps_pinned(tmp_path: Path) -> None:
    registry = open_registry(str(tmp_path / "store"), create=True)
    for i, name in enumerate(("pinned", "a", "b")):
        folder = make_synthetic_adapter(tmp_path / name, d_in=256, d_out=256, r=8, seed=i)
        registry.publish_adapter(folder, name, "1")
    one = registry.manifest("adapter", "a", "1").total_size
    source = AdapterStoreSource(
        registry=registry,
        cache_dir=tmp_path / "cache",
        cache_bytes=int(2.5 * one),  # room for two entries
        direct_local=False,
    )
    source.pin("pinned")
    for ref in ("pinned@1", "a@1", "pinned@1", "b@1"):
        source.adapter_path(ref)
    tier = source.disk_tier()
    assert tier["adapters"] == ["b", "pinned"]  # a was the least recently used unpinned entry
    assert (tier["hits"], tier["misses"], tier["loads"], tier["evictions"]) == (1, 3, 3, 1)
    assert tier["capacity_bytes"] == int(2.5 * one) and 0 < tier["bytes"] <= int(2.5 * one)
    assert source.on_disk("pinned") and source.on_disk("b@1") and not source.on_disk("a")


def test_a_local_store_is_the_disk_tier(tmp_path: Path) -> None:
    registry = open_registry(str(tmp_path / "store"), create=True)
    registry.publish_adapter(make_synthetic_adapter(tmp_path / "x"), "x", "1")
    source = AdapterStoreSource(registry=registry, cache_dir=tmp_path / "cache")
    source.adapter_path("x")
    tier = source.disk_tier()
    assert tier["hits"] == 1 and tier["misses"] == 0 and tier["capacity_bytes"] is None
    assert source.on_disk("x")


def test_validation_checks_the_manifest_without_downloading(tmp_path: Path) -> None:
    registry = open_registry(str(tmp_path / "store"), create=True)
    registry.publish_adapter(make_synthetic_adapter(tmp_path / "x"), "x", "1")
    source = AdapterStoreSource(registry=registry, cache_dir=tmp_path / "cache", direct_local=False)
    source.check_adapter("x")
    source.check_adapter("x@1")
    assert source.disk_tier()["adapters"] == [] and not source.on_disk("x")
    with pytest.raises(NotFoundError):
        source.check_adapter("ghost")
    with pytest.raises(NotFoundError):
        source.check_adapter("x@9")
