"""Conditional publish: of two concurrent publishes of one version exactly one wins, and the
loser's files are gone."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

from adapter_store import Registry, VersionExistsError, open_registry
from adapter_store.layout import MANIFEST

SPAWN = mp.get_context("spawn")


def _publish(url: str, folder: str, barrier: mp.Barrier, out: mp.Queue) -> None:
    registry = open_registry(url, create=True)
    staged = registry.stage_adapter(folder, "raced", "1")  # both upload before either commits
    barrier.wait(timeout=60)
    try:
        m = staged.commit()
        out.put(("won", m.blob_dir))
    except VersionExistsError as exc:
        out.put(("lost", str(exc)))


def test_two_processes_one_wins(
    registry: Registry, store_url: str, alpha: Path, beta: Path
) -> None:
    barrier, out = SPAWN.Barrier(2), SPAWN.Queue()
    procs = [
        SPAWN.Process(target=_publish, args=(store_url, str(f), barrier, out))
        for f in (alpha, beta)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    outcomes = sorted(r[0] for r in results)
    assert outcomes == ["lost", "won"], results
    winner_blob = next(r[1] for r in results if r[0] == "won")
    manifest = registry.manifest("adapter", "raced", "1")
    assert manifest.blob_dir == winner_blob
    keys = registry.backend.list_keys("adapters/raced/1/")
    assert {k.split("/")[3] for k in keys if not k.endswith(MANIFEST)} == {winner_blob}
    assert registry.verify(manifest) == []


def test_staged_loser_cleans_up(registry: Registry, alpha: Path, beta: Path) -> None:
    slow = registry.stage_adapter(alpha, "raced", "1")
    fast = registry.publish_adapter(beta, "raced", "1")
    try:
        slow.commit()
        raise AssertionError("second commit must lose")
    except VersionExistsError as exc:
        assert "published concurrently" in str(exc)
    keys = registry.backend.list_keys("adapters/raced/1/")
    assert all(fast.blob_dir in k or k.endswith(MANIFEST) for k in keys)
    assert registry.manifest("adapter", "raced", "1").rank == 8  # beta's, untouched
