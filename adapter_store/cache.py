"""The local verified cache: `<root>/<kind>s/<name>/<version>/` = the files + manifest.json.

An entry appears by renaming a fully downloaded and checksummed temp folder into place, under a
per-version file lock, so concurrent pullers (threads or processes) download once and readers
never see a partial folder. A byte budget is kept by evicting least-recently-used entries;
pinned names are never evicted. `counters` feed the runtime's per-tier metrics (the disk tier).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import threading
import time
import uuid
from pathlib import Path

from filelock import FileLock, Timeout

from adapter_store.backends.base import Progress
from adapter_store.counters import TierCounters
from adapter_store.errors import IntegrityError, disk_full
from adapter_store.layout import MANIFEST, AnyManifest, kind_prefix
from adapter_store.manifest import parse_manifest
from adapter_store.names import Kind, check_name, check_version
from adapter_store.validate import sha256_file
from adapter_store.versions import Registry

log = logging.getLogger(__name__)
LAST_USED = ".last_used"
STALE_TMP_S = 6 * 3600


USAGE_TTL_S = 2.0  # how long a measured usage is reused (it walks every entry)


class LocalCache:
    def __init__(self, root: str | Path, max_bytes: int, lock_timeout_s: float = 600.0) -> None:
        self.root = Path(root).expanduser().absolute()
        self.max_bytes = max_bytes
        self.lock_timeout_s = lock_timeout_s
        self._tmp = self.root / ".tmp"
        self._locks = self.root / ".locks"
        self.counters = TierCounters()  # the disk tier's, this process' look-ups
        self.pinned: set[tuple[str, str]] = set()  # (kind, name): never evicted
        self._count_lock = threading.Lock()
        self._usage: tuple[float, int] | None = None
        self._names: dict[str, tuple[float, list[str]]] = {}
        self._verified: dict[Path, tuple[int, int, int, str]] = {}

    def count(self, **deltas: int) -> None:
        """Add to the counters (fetch workers of one replica call this concurrently)."""
        with self._count_lock:
            for key, n in deltas.items():
                setattr(self.counters, key, getattr(self.counters, key) + n)

    def pin(self, kind: Kind, name: str) -> None:
        self.pinned.add((kind, check_name(name)))

    def cached_names(self, kind: Kind) -> list[str]:
        """Names with at least one complete cached version (the residency view's disk tier),
        listed at most every USAGE_TTL_S: the replica reads it at 1 Hz on its event loop, and
        the listing walks every cached adapter."""
        now = time.monotonic()
        seen = self._names.get(kind)
        if seen is None or now - seen[0] > USAGE_TTL_S:
            base = self.root / kind_prefix(kind)
            names = (
                sorted(
                    d.name
                    for d in base.iterdir()
                    if any((v / MANIFEST).is_file() for v in d.glob("*"))
                )
                if base.is_dir()
                else []
            )
            seen = self._names[kind] = (now, names)
        return seen[1]

    def usage_cached(self) -> int:
        """`usage()`, measured at most every USAGE_TTL_S (for 1 Hz stats)."""
        now = time.monotonic()
        if self._usage is None or now - self._usage[0] > USAGE_TTL_S:
            self._usage = (now, self.usage())
        return self._usage[1]

    def entry_dir(self, kind: Kind, name: str, version: str) -> Path:
        return self.root / kind_prefix(kind) / check_name(name) / check_version(version)

    def _lock(self, kind: Kind, name: str, version: str) -> FileLock:
        self._locks.mkdir(parents=True, exist_ok=True)
        return FileLock(
            str(self._locks / f"{kind}-{name}-{version}.lock"), timeout=self.lock_timeout_s
        )

    @staticmethod
    def touch(entry: Path) -> None:
        """Mark an entry as just used (LRU order = mtime of its `.last_used`)."""
        with contextlib.suppress(FileNotFoundError):  # evicted meanwhile: nothing to mark
            (entry / LAST_USED).touch()

    def get(
        self, kind: Kind, name: str, version: str, manifest: AnyManifest | None = None
    ) -> Path | None:
        """The cached folder if present and its files still match `manifest` (the store's; the
        cached manifest.json when none is given). A changed or damaged entry is dropped and
        None returned, so the caller downloads it again."""
        entry = self.entry_dir(kind, name, version)
        if not (entry / MANIFEST).is_file():
            return None
        try:
            want = manifest or parse_manifest((entry / MANIFEST).read_bytes(), str(entry))
            problem = self._mismatch(entry, want)
        except (FileNotFoundError, IntegrityError) as exc:
            problem = str(exc)
        if problem is not None:
            log.warning("store cache %s: dropping %s@%s: %s", self.root, name, version, problem)
            self.remove(kind, name, version)
            return None
        self.touch(entry)
        return entry

    def _remember(self, entry: Path, manifest: AnyManifest) -> None:
        """Files just downloaded were hashed on the way in: no need to hash them on first use."""
        for f in manifest.files:
            st = (entry / f.path).lstat()
            with self._count_lock:
                self._verified[entry / f.path] = (st.st_size, st.st_mtime_ns, st.st_ino, f.sha256)

    def _mismatch(self, entry: Path, manifest: AnyManifest) -> str | None:
        """What differs between the cached files and the manifest (size, sha256), if anything;
        a file is hashed again only when its size, mtime or inode changed."""
        for f in manifest.files:
            path = entry / f.path
            st = path.lstat()
            if not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
                return f"{f.path} is not the {f.size}-byte file of the manifest"
            stamp = (st.st_size, st.st_mtime_ns, st.st_ino, f.sha256)
            with self._count_lock:
                if self._verified.get(path) == stamp:
                    continue
            if sha256_file(path) != f.sha256:
                return f"{f.path} does not match its manifest sha256"
            with self._count_lock:
                self._verified[path] = stamp
        return None

    def pull(
        self, registry: Registry, manifest: AnyManifest, progress: Progress | None = None
    ) -> Path:
        """Download, verify and install one version; a no-op if another puller got there first."""
        kind, name, version = manifest.kind, manifest.name, manifest.version
        entry = self.entry_dir(kind, name, version)
        with self._lock(kind, name, version):
            if (entry / MANIFEST).is_file():
                self.touch(entry)
                return entry
            self._tmp.mkdir(parents=True, exist_ok=True)
            tmp = self._tmp / f"{name}-{version}-{uuid.uuid4().hex}"
            tmp.mkdir()
            try:
                for f in manifest.files:
                    registry.fetch_to(manifest, f, tmp / f.path, progress)
                (tmp / MANIFEST).write_bytes(manifest.model_dump_json(indent=2).encode())
                (tmp / LAST_USED).touch()
                entry.parent.mkdir(parents=True, exist_ok=True)
                os.rename(tmp, entry)
                self._remember(entry, manifest)
                self.count(loads=1)
            except OSError as exc:
                full = disk_full(
                    exc, f"store cache {self.root}: downloading {kind} {name}@{version}"
                )
                if full is None:
                    raise
                raise full from exc
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        self.evict(keep={entry})
        return entry

    def entries(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return [
            p
            for kind_dir in self.root.glob("*s")
            if not kind_dir.name.startswith(".")
            for p in kind_dir.glob("*/*")
            if (p / MANIFEST).is_file()
        ]

    @staticmethod
    def entry_size(entry: Path) -> int:
        return sum(p.stat().st_size for p in entry.iterdir() if p.is_file())

    def usage(self) -> int:
        return sum(self.entry_size(e) for e in self.entries())

    def cached_manifests(self, kind: Kind, name: str) -> list[AnyManifest]:
        """Manifests of the cached versions of one name (for serving while the store is down)."""
        base = self.root / kind_prefix(kind) / check_name(name)
        out = []
        for entry in base.glob("*") if base.is_dir() else []:
            try:
                out.append(parse_manifest((entry / MANIFEST).read_bytes(), str(entry)))
            except (FileNotFoundError, IntegrityError):
                continue
        return out

    def remove(self, kind: Kind, name: str, version: str) -> bool:
        entry = self.entry_dir(kind, name, version)
        with self._lock(kind, name, version):
            return self._drop(entry)

    def _drop(self, entry: Path) -> bool:
        if not entry.is_dir():
            return False
        self._tmp.mkdir(parents=True, exist_ok=True)
        trash = self._tmp / f"evict-{uuid.uuid4().hex}"
        os.rename(entry, trash)  # disappears atomically for readers
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def evict(self, keep: set[Path] | frozenset[Path] = frozenset()) -> list[Path]:
        """Drop least-recently-used entries until the cache fits its byte budget."""
        self._locks.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self._locks / "evict.lock"), timeout=self.lock_timeout_s):
            self._clean_stale_tmp()
            sized = []
            for entry in self.entries():
                try:
                    stamp = (entry / LAST_USED).stat().st_mtime
                except FileNotFoundError:
                    stamp = 0.0
                sized.append((stamp, entry, self.entry_size(entry)))
            total = sum(size for _, _, size in sized)
            evicted = []
            for _, entry, size in sorted(sized, key=lambda t: t[0]):
                if total <= self.max_bytes:
                    break
                kind, name, version = entry.parent.parent.name[:-1], entry.parent.name, entry.name
                if entry in keep or (kind, name) in self.pinned:
                    continue
                try:
                    with self._lock(kind, name, version).acquire(timeout=0):  # type: ignore[arg-type]
                        if self._drop(entry):
                            total -= size
                            evicted.append(entry)
                            self.count(evictions=1)
                except Timeout:
                    continue  # being pulled right now
            if total > self.max_bytes:
                log.warning(
                    "store cache holds %d bytes, over its %d-byte budget", total, self.max_bytes
                )
            return evicted

    def _clean_stale_tmp(self) -> None:
        if not self._tmp.is_dir():
            return
        now = time.time()
        for leftover in self._tmp.iterdir():
            try:
                if now - leftover.stat().st_mtime > STALE_TMP_S:
                    shutil.rmtree(leftover, ignore_errors=True)
            except FileNotFoundError:
                continue
