"""The cache path under a hostile disk: a cached blob changed on disk is never served again
without its checksum, and a full disk is a clear DiskFullError that leaves nothing partial."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from adapter_store import AdapterStoreSource, DiskFullError, LocalCache, Registry, open_registry


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_cached_blob_reverified_on_every_hit(
    registry: Registry, alpha: Path, tmp_path: Path
) -> None:
    """Both backends through the cache (S3 always goes through it): a planted change in a cached
    file is caught on the next hit, the entry dropped and a verified copy downloaded again."""
    source = AdapterStoreSource(registry=registry, cache_dir=tmp_path / "cache", direct_local=False)
    registry.publish_adapter(alpha, "alpha", "1")
    first = source.path("adapter", "alpha")
    weights = first / "adapter_model.safetensors"
    good = weights.read_bytes()
    _flip(weights)
    again = source.path("adapter", "alpha")  # latest: checked against the store's manifest
    assert (again / "adapter_model.safetensors").read_bytes() == good
    _flip(again / "adapter_model.safetensors")
    pinned = source.path("adapter", "alpha@1")  # exact version: against the cached manifest
    assert (pinned / "adapter_model.safetensors").read_bytes() == good
    assert source.cache.counters.loads == 3


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 256 KiB filesystem (tmpfs); skipped where mounting is not permitted."""
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def _big(alpha: Path, tmp_path: Path) -> Path:
    """The alpha adapter with a README large enough not to fit the tiny disk."""
    folder = Path(shutil.copytree(alpha, tmp_path / "big"))
    (folder / "README.md").write_text("x" * 400_000)
    return folder


def test_full_disk_on_cache_pull(
    registry: Registry, alpha: Path, tmp_path: Path, tiny_disk: Path
) -> None:
    registry.publish_adapter(_big(alpha, tmp_path), "big", "1")
    cache = LocalCache(tiny_disk / "cache", max_bytes=1 << 30)
    with pytest.raises(DiskFullError, match=r"store cache .*downloading adapter big@1: no space"):
        cache.pull(registry, registry.latest("adapter", "big"))
    assert cache.get("adapter", "big", "1") is None
    assert not any(p.is_file() for p in (tiny_disk / "cache").rglob("*") if ".locks" not in p.parts)


def test_full_disk_on_local_publish(alpha: Path, tmp_path: Path, tiny_disk: Path) -> None:
    registry = open_registry(str(tiny_disk / "store"), create=True)
    with pytest.raises(DiskFullError, match=r"local store .*no space left"):
        registry.publish_adapter(_big(alpha, tmp_path), "big", "1")
    assert registry.names("adapter") == []
