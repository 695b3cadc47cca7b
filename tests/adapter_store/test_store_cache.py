"""The verified cache: checksums, atomic install, LRU byte budget, many pullers, offline serving."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from adapter_store import (
    AdapterStoreSource,
    IntegrityError,
    LocalCache,
    Registry,
    StoreUnavailableError,
)
from adapter_store.backends.s3 import S3Backend
from adapter_store.layout import blob_key
from adapter_store.validate import sha256_file
from tests.adapter_store.puller import pull_in_process
from tests.adapter_store.store_helpers import make_synthetic_adapter
from tests.support.ports import free_port

SPAWN = mp.get_context("spawn")


def _corrupt(registry: Registry, manifest, path: str) -> None:  # type: ignore[no-untyped-def]
    key = blob_key(manifest, path)
    data = bytearray(registry.backend.read_bytes(key))
    data[len(data) // 2] ^= 0xFF
    registry.backend.put_bytes(key, bytes(data))


def _files(cache: LocalCache) -> list[Path]:
    files = (p.relative_to(cache.root) for p in cache.root.rglob("*") if p.is_file())
    return sorted(p for p in files if p.parts[0] != ".locks")


def test_corrupted_object_fails_and_cache_untouched(
    registry: Registry, alpha: Path, tmp_path: Path
) -> None:
    cache = LocalCache(tmp_path / "cache", max_bytes=1 << 30)
    good = registry.publish_adapter(alpha, "alpha", "1")
    cache.pull(registry, good)
    bad = registry.publish_adapter(alpha, "alpha", "2")
    _corrupt(registry, bad, "adapter_model.safetensors")
    before = _files(cache)
    with pytest.raises(
        IntegrityError, match=r"alpha@2: adapter_model.safetensors failed verification"
    ):
        cache.pull(registry, bad)
    assert _files(cache) == before  # no partial entry, no temp files, the good version intact
    assert cache.get("adapter", "alpha", "2") is None
    assert list((cache.root / ".tmp").iterdir()) == []
    assert registry.verify(bad) and not registry.verify(good)


def test_local_store_in_place_read_is_verified(
    registry: Registry, alpha: Path, tmp_path: Path
) -> None:
    source = AdapterStoreSource(registry=registry, cache_dir=tmp_path / "cache")
    m = registry.publish_adapter(alpha, "alpha", "1")
    folder = source.adapter_path("alpha@1")
    if registry.backend.local_path("x") is None:
        assert folder.is_relative_to(tmp_path / "cache")
        return
    assert folder.is_relative_to(Path(registry.url))  # read in place, no copy
    _corrupt(registry, m, "adapter_config.json")
    with pytest.raises(IntegrityError, match="does not match its manifest checksum"):
        source.adapter_path("alpha@1")


def test_eviction_keeps_budget_lru(registry: Registry, tmp_path: Path) -> None:
    manifests = []
    for i in range(4):
        folder = make_synthetic_adapter(tmp_path / f"a{i}", d_in=256, d_out=256, r=8, seed=i)
        manifests.append(registry.publish_adapter(folder, f"ev{i}", "1"))
    size = manifests[0].total_size
    cache = LocalCache(tmp_path / "cache", max_bytes=int(2.5 * size) + 4096)  # room for two
    cache.pull(registry, manifests[0])
    cache.pull(registry, manifests[1])
    cache.get("adapter", "ev0", "1")  # ev0 is now more recent than ev1
    _age(cache, "ev1", 100)
    cache.pull(registry, manifests[2])
    assert _cached(cache) == {"ev0", "ev2"}
    _age(cache, "ev0", 200)
    cache.pull(registry, manifests[3])
    assert _cached(cache) == {"ev2", "ev3"}
    assert cache.usage() <= cache.max_bytes


def _age(cache: LocalCache, name: str, seconds: float) -> None:
    stamp = cache.entry_dir("adapter", name, "1") / ".last_used"
    old = time.time() - seconds
    os.utime(stamp, (old, old))


def _cached(cache: LocalCache) -> set[str]:
    return {e.parent.name for e in cache.entries()}


@pytest.mark.slow  # starts processes
def test_concurrent_pullers_across_processes(
    registry: Registry, store_url: str, tmp_path: Path
) -> None:
    folder = make_synthetic_adapter(tmp_path / "big", d_in=1024, d_out=1024, r=64, layers=4)
    m = registry.publish_adapter(folder, "shared", "1")
    out = SPAWN.Queue()
    procs = [
        SPAWN.Process(target=pull_in_process, args=(store_url, str(tmp_path / "cache"), out))
        for _ in range(3)
    ]
    for p in procs:
        p.start()
    paths = {out.get(timeout=120) for _ in procs}
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(paths) == 1
    entry = Path(paths.pop())
    cache = LocalCache(tmp_path / "cache", max_bytes=1 << 30)
    assert cache.entries() == [entry]

    for f in m.files:
        assert sha256_file(entry / f.path) == f.sha256
    assert list((tmp_path / "cache" / ".tmp").iterdir()) == []


def _dead_backend():  # type: ignore[no-untyped-def]
    """An S3 backend whose endpoint refuses connections (nothing listens there)."""
    return S3Backend(
        "gone",
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        max_attempts=1,
        connect_timeout=1,
    )


def test_cached_versions_serve_while_store_down(
    registry: Registry,
    alpha: Path,
    beta: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    online = AdapterStoreSource(registry=registry, cache_dir=tmp_path / "cache", direct_local=False)
    registry.publish_adapter(alpha, "alpha", "1")
    registry.publish_adapter(beta, "alpha", "2")
    registry.publish_adapter(beta, "beta", "1")
    p1, p2 = online.adapter_path("alpha@1"), online.adapter_path("alpha@2")
    # Credentials for the dead endpoint: without any, boto refuses before it connects (a
    # StoreAccessError, not "down"), and this test passed only after a SeaweedFS test set them.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "dead")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "dead")
    offline = AdapterStoreSource(registry=Registry(_dead_backend()), cache_dir=tmp_path / "cache")
    assert offline.adapter_path("alpha@1") == p1  # pinned + cached: no network at all
    with caplog.at_level(logging.WARNING, logger="adapter_store"):
        assert offline.adapter_path("alpha") == p2  # newest cached
    assert "is down" in caplog.text
    with pytest.raises(StoreUnavailableError, match="not cached and the store is down"):
        offline.adapter_path("beta@1")
    with pytest.raises(StoreUnavailableError, match="store is down and no version is cached"):
        offline.adapter_path("beta")
