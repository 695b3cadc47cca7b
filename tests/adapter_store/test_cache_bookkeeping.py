"""What the cache costs a request once it holds many entries: a file is hashed once per node
(not per process), a tampered file is still caught, and stats or eviction walk no files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from adapter_store import LocalCache, Registry
from adapter_store import cache as cache_module
from tests.adapter_store.store_helpers import make_synthetic_adapter


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every file the cache hashes to check an entry, in order."""
    seen: list[Path] = []
    real = cache_module.sha256_file

    def counting(path: Path) -> str:
        seen.append(Path(path))
        return real(path)

    monkeypatch.setattr(cache_module, "sha256_file", counting)
    return seen


def _published(registry: Registry, tmp_path: Path, n: int) -> list:  # type: ignore[type-arg]
    out = []
    for i in range(n):
        folder = make_synthetic_adapter(tmp_path / f"a{i}", d_in=16, d_out=16, r=2, layers=1)
        out.append(registry.publish_adapter(folder, f"b{i}", "1"))
    return out


def test_a_new_process_does_not_hash_what_the_node_already_hashed(
    registry: Registry, tmp_path: Path, hashed: list[Path]
) -> None:
    (m,) = _published(registry, tmp_path, 1)
    LocalCache(tmp_path / "cache", max_bytes=1 << 30).pull(registry, m)
    restarted = LocalCache(tmp_path / "cache", max_bytes=1 << 30)
    assert restarted.get("adapter", "b0", "1") is not None
    assert hashed == []  # the stamps written at download time stand for the hash


def test_entries_without_stamps_are_hashed_once_then_stamped(
    registry: Registry, tmp_path: Path, hashed: list[Path]
) -> None:
    (m,) = _published(registry, tmp_path, 1)
    entry = LocalCache(tmp_path / "cache", max_bytes=1 << 30).pull(registry, m)
    (entry / cache_module.VERIFIED).unlink()  # as made by an older release
    assert LocalCache(tmp_path / "cache", max_bytes=1 << 30).get("adapter", "b0", "1")
    assert len(hashed) == len(m.files)
    assert LocalCache(tmp_path / "cache", max_bytes=1 << 30).get("adapter", "b0", "1")
    assert len(hashed) == len(m.files)  # a third process reads the stamps the second wrote


@pytest.mark.parametrize("forge", ["same_size_rewrite", "restored_mtime", "garbled_stamps"])
def test_a_changed_file_is_caught_despite_saved_stamps(
    registry: Registry, tmp_path: Path, forge: str
) -> None:
    (m,) = _published(registry, tmp_path, 1)
    entry = LocalCache(tmp_path / "cache", max_bytes=1 << 30).pull(registry, m)
    weights = entry / "adapter_model.safetensors"
    before = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    if forge == "restored_mtime":  # the ctime still moves
        os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    if forge == "garbled_stamps":
        (entry / cache_module.VERIFIED).write_text('{"adapter_model.safetensors": "yes"}')
    assert LocalCache(tmp_path / "cache", max_bytes=1 << 30).get("adapter", "b0", "1") is None
    assert not entry.exists()  # dropped, so the next pull downloads it again


def test_stats_and_a_pull_within_budget_walk_no_files(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifests = _published(registry, tmp_path, 3)
    cache = LocalCache(tmp_path / "cache", max_bytes=1 << 30)
    for m in manifests[:2]:
        cache.pull(registry, m)
    assert cache.cached_names("adapter") == ["b0", "b1"]
    usage = cache.usage_cached()
    assert usage == cache.usage()
    sized: list[Path] = []
    real = LocalCache.entry_size
    monkeypatch.setattr(
        LocalCache, "entry_size", staticmethod(lambda e: sized.append(e) or real(e))
    )
    monkeypatch.setattr(LocalCache, "entries", lambda self: pytest.fail("walked the cache"))
    cache.pull(registry, manifests[2])
    assert sized == [cache.entry_dir("adapter", "b2", "1")]  # only the new entry is sized
    assert cache.cached_names("adapter") == ["b0", "b1", "b2"]
    assert cache.usage_cached() > usage
    cache.remove("adapter", "b0", "1")
    assert cache.cached_names("adapter") == ["b1", "b2"]
