"""The local verified cache: `<root>/<kind>s/<name>/<version>/` = the files + manifest.json.

An entry appears by renaming a fully downloaded and checksummed temp folder into place, under a
per-version file lock, so concurrent pullers (threads or processes) download once and readers
never see a partial folder. A byte budget is kept by evicting least-recently-used entries;
pinned names are never evicted. `counters` feed the runtime's per-tier metrics (the disk tier).
"""

from __future__ import annotations

import contextlib
import json
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


LISTING_TTL_S = 10.0  # how long a walk of every entry is reused (metrics export every 10 s)
VERIFIED = ".verified.json"  # the stat stamps of an entry's files when they were last hashed

Stamp = tuple[int, int, int, int, str]  # size, mtime_ns, ctime_ns, inode, sha256


def stamp_of(st: os.stat_result, sha256: str) -> Stamp:
    """What a hashed file looked like: any write, replacement or `utime` changes it (the
    ctime cannot be set back), so a file whose stamp matches still has that hash."""
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, sha256)


class LocalCache:
    def __init__(self, root: str | Path, max_bytes: int, lock_timeout_s: float = 600.0) -> None:
        self.root = Path(root).expanduser().absolute()
        self.max_bytes = max_bytes
        self.lock_timeout_s = lock_timeout_s
        self._tmp = self.root / ".tmp"
        self._locks = self.root / ".locks"
        self.counters = TierCounters()  # the disk tier's, this process' look-ups
        self.pinned: set[tuple[str, str]] = set()  # (kind, name): never evicted
        self._state_lock = threading.Lock()  # counters, listing, verified stamps: fetch threads
        self._listing: tuple[float, dict[Path, int]] | None = None  # (walked at, entry -> bytes)
        self._verified: dict[Path, Stamp] = {}

    def count(self, **deltas: int) -> None:
        """Add to the counters (fetch workers of one replica call this concurrently)."""
        with self._state_lock:
            for key, n in deltas.items():
                setattr(self.counters, key, getattr(self.counters, key) + n)

    def pin(self, kind: Kind, name: str) -> None:
        self.pinned.add((kind, check_name(name)))

    def listing(self, max_age_s: float = LISTING_TTL_S) -> dict[Path, int]:
        """Every complete entry and its bytes, walked at most every `max_age_s` and kept up to
        date by this process' own pulls and drops in between (other processes sharing the
        folder show at the next walk). Entries never change once in place, so a walk sizes
        only the ones it has not seen: stats and eviction cost a listing, not a stat per file."""
        with self._state_lock:
            if self._listing is not None and time.monotonic() - self._listing[0] <= max_age_s:
                return dict(self._listing[1])
            known = dict(self._listing[1]) if self._listing is not None else {}
        walked = {}
        for entry in self.entries():
            size = known.get(entry)
            if size is None:
                with contextlib.suppress(FileNotFoundError):  # evicted meanwhile
                    size = self.entry_size(entry)
            if size is not None:
                walked[entry] = size
        with self._state_lock:
            self._listing = (time.monotonic(), walked)
        return dict(walked)

    def _listed(self, entry: Path, size: int | None) -> None:
        """This process put (`size`) or dropped (None) an entry: the listing follows at once."""
        with self._state_lock:
            if self._listing is None:
                return
            if size is None:
                self._listing[1].pop(entry, None)
            else:
                self._listing[1][entry] = size

    def cached_names(self, kind: Kind) -> list[str]:
        """Names with at least one complete cached version (the residency view's disk tier)."""
        base = self.root / kind_prefix(kind)
        return sorted({e.parent.name for e in self.listing() if e.parent.parent == base})

    def usage_cached(self) -> int:
        """Bytes in the cache as of the last listing (for 1 Hz stats)."""
        return sum(self.listing().values())

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

    def _stamps(self, folder: Path, manifest: AnyManifest) -> dict[str, Stamp]:
        return {f.path: stamp_of((folder / f.path).lstat(), f.sha256) for f in manifest.files}

    def _save_stamps(self, folder: Path, manifest: AnyManifest) -> None:
        """Record the stamps of files just hashed, so no process of this node hashes them
        again until they change (best effort: a read-only cache just hashes on each start)."""
        tmp = folder / f"{VERIFIED}.{uuid.uuid4().hex}"
        try:
            tmp.write_text(json.dumps(self._stamps(folder, manifest)))
            os.replace(tmp, folder / VERIFIED)
        except OSError as exc:
            log.debug("store cache %s: stamps not saved: %s", folder, exc)
            tmp.unlink(missing_ok=True)

    @staticmethod
    def _saved_stamps(entry: Path) -> dict[str, Stamp]:
        try:
            raw = json.loads((entry / VERIFIED).read_bytes())
            return {k: tuple(v) for k, v in raw.items()}  # type: ignore[misc]
        except (OSError, ValueError, TypeError, AttributeError):
            return {}

    def _remember(self, entry: Path, manifest: AnyManifest) -> None:
        """Files just downloaded were hashed on the way in: no need to hash them on first use."""
        stamps = self._stamps(entry, manifest)
        with self._state_lock:
            for rel, stamp in stamps.items():
                self._verified[entry / rel] = stamp

    def _mismatch(self, entry: Path, manifest: AnyManifest) -> str | None:
        """What differs between the cached files and the manifest (size, sha256), if anything;
        a file is hashed again only when its stamp changed since this process or another of
        this node last hashed it."""
        saved: dict[str, Stamp] | None = None
        hashed = False
        for f in manifest.files:
            path = entry / f.path
            st = path.lstat()
            if not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
                return f"{f.path} is not the {f.size}-byte file of the manifest"
            stamp = stamp_of(st, f.sha256)
            with self._state_lock:
                if self._verified.get(path) == stamp:
                    continue
            if saved is None:
                saved = self._saved_stamps(entry)
            if saved.get(f.path) != stamp:
                if sha256_file(path) != f.sha256:
                    return f"{f.path} does not match its manifest sha256"
                hashed = True
            with self._state_lock:
                self._verified[path] = stamp
        if hashed:
            self._save_stamps(entry, manifest)
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
                self._save_stamps(tmp, manifest)
                (tmp / LAST_USED).touch()
                entry.parent.mkdir(parents=True, exist_ok=True)
                os.rename(tmp, entry)
                self._remember(entry, manifest)
                self._listed(entry, self.entry_size(entry))
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
        self._listed(entry, None)
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def evict(self, keep: set[Path] | frozenset[Path] = frozenset()) -> list[Path]:
        """Drop least-recently-used entries until the cache fits its byte budget. Within
        budget by the listing (at most LISTING_TTL_S old), nothing is walked."""
        if sum(self.listing().values()) <= self.max_bytes:
            return []
        self._locks.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self._locks / "evict.lock"), timeout=self.lock_timeout_s):
            self._clean_stale_tmp()
            sized = []
            for entry, size in self.listing(max_age_s=0.0).items():
                try:
                    stamp = (entry / LAST_USED).stat().st_mtime
                except FileNotFoundError:
                    stamp = 0.0
                sized.append((stamp, entry, size))
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
