"""A real server dying mid-download: a clean StoreUnavailableError and no partial file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from adapter_store import AdapterStoreSource, LocalCache, Registry, StoreUnavailableError
from adapter_store.backends.s3 import S3Backend
from tests.adapter_store.store_helpers import make_synthetic_adapter
from tests.support.seaweedfs import SeaweedFS

pytestmark = pytest.mark.slow  # starts a SeaweedFS of its own (`doomed`)


@pytest.fixture
def doomed(tmp_path: Path) -> Iterator[SeaweedFS]:
    """A private server this test may kill (the session one stays up)."""
    server = SeaweedFS(tmp_path / "doomed").start()
    yield server
    server.stop()


def test_server_killed_mid_download(
    doomed: SeaweedFS, alpha: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in doomed.env().items():
        monkeypatch.setenv(key, value)
    bucket = doomed.create_bucket()
    backend = S3Backend(bucket, "p", max_attempts=1, connect_timeout=1, read_timeout=3)
    registry = Registry(backend)
    big = make_synthetic_adapter(tmp_path / "big", layers=2, d_in=4096, d_out=4096, r=512)
    manifest = registry.publish_adapter(big, "big", "1")
    small = registry.publish_adapter(alpha, "small", "1")
    assert manifest.total_size > 30 * 1024 * 1024
    cache_dir = tmp_path / "cache"
    source = AdapterStoreSource(registry=registry, cache_dir=cache_dir, cache_bytes=1 << 30)
    cached_small = source.adapter_path("small@1")

    seen = []

    def kill_after_first_chunk(n: int) -> None:
        seen.append(n)
        if len(seen) == 1:
            doomed.kill()

    with pytest.raises(StoreUnavailableError, match="unreachable"):
        source.path("adapter", "big@1", progress=kill_after_first_chunk)
    assert sum(seen) < manifest.total_size
    cache = LocalCache(cache_dir, max_bytes=1 << 30)
    assert cache.get("adapter", "big", "1") is None
    assert list((cache_dir / ".tmp").iterdir()) == []
    assert not list(cache_dir.rglob("adapter_model.safetensors.*"))
    # The store is gone for good now: cached versions still serve, others say the store is down.
    source._latest.clear()
    assert source.adapter_path("small@1") == cached_small
    assert source.adapter_path("small") == cached_small
    with pytest.raises(StoreUnavailableError, match="store is down"):
        source.adapter_path("big")
    assert small.ref == "small@1"
