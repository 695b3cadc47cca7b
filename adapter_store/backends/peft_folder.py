"""A read-only registry view of a plain prefix of PEFT folders, each version its content hash.

This is Ray Serve LLM's `dynamic_lora_loading_path` layout: `<prefix>/<name>/adapter_config.json`
and `adapter_model.safetensors` (a `README.md` is kept; other files are never read). Each
folder is one adapter whose only version is a hash of its files' sha256s. Its manifest is
derived the first time the folder is seen (files fetched, checked by the push rulebook, hashed)
and kept while the listing shows the same sizes and tags (each file is read once: the rulebook
and the hash see the same bytes; with a `memo`, kept on disk across restarts too), so the
registry, the verified cache and every reader work unchanged over the virtual keys

    adapters/<name>/<version>/manifest.json           derived, never stored
    adapters/<name>/<version>/u-peft-folder/<file>    = <prefix>/<name>/<file>

A folder that breaks a rule is left out of the listing with a logged reason (`problems()`);
editing a folder makes a new version, and a reader holding the old one gets a checksum error.
Every write is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, Protocol

from adapter_store.backends.base import Backend, ObjectMissingError, ObjectStat, Progress
from adapter_store.backends.derived_memo import DerivedMemo, Stamp
from adapter_store.backends.readonly import refuse_write
from adapter_store.errors import InvalidInputError
from adapter_store.layout import MANIFEST
from adapter_store.manifest import AdapterManifest, FileEntry, dump_manifest
from adapter_store.names import NAME_RE
from adapter_store.staging import HashingWriter
from adapter_store.validate import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    DEFAULT_MAX_BYTES,
    README,
    check_adapter_contents,
)

log = logging.getLogger(__name__)

BLOB_DIR = "u-peft-folder"
USED_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, README)
VERSION_CHARS = 16
DERIVE_WORKERS = 8  # folders a catalog load derives at once
SPOOL_BYTES = 64 * 2**20  # a folder's file is read into memory up to this size, then to disk
BAD_NAME = (
    "the folder name is not an adapter name (1-64 lowercase letters, digits, '.', '_' or '-'); "
    "rename the folder"
)
WHY = "a folder of PEFT adapters, served as they are"


class StatBackend(Backend, Protocol):
    def list_stats(self, prefix: str) -> dict[str, ObjectStat]: ...

    def list_folder_stats(self, prefix: str) -> dict[str, dict[str, ObjectStat]]: ...


def content_version(entries: list[tuple[str, str]]) -> str:
    """The version of a folder: a hash over its (file name, sha256) pairs."""
    digest = hashlib.sha256()
    for path, sha in sorted(entries):
        digest.update(f"{path}\0{sha}\n".encode())
    return digest.hexdigest()[:VERSION_CHARS]


class PeftFolderBackend:
    def __init__(
        self,
        inner: StatBackend,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        stats_ttl_s: float = 1.0,
        memo: DerivedMemo | None = None,
    ) -> None:
        """`memo`: derived manifests kept on disk across restarts (none: kept in memory)."""
        self.inner = inner
        self.memo = memo
        self.max_bytes = max_bytes
        self.stats_ttl_s = stats_ttl_s
        self._listed: dict[str, tuple[float, dict[str, ObjectStat]]] = {}
        self.url = f"peft:{inner.url}"
        self._derived: dict[str, tuple[Stamp, AdapterManifest | None, str | None]] = {}
        self._lock = threading.Lock()

    # ---- deriving manifests ----------------------------------------------------------------------

    def current(self, name: str) -> AdapterManifest | None:
        """The manifest of folder `name` as it is now (None: no such servable adapter)."""
        if not NAME_RE.fullmatch(name) or name in {".", ".."}:
            return None
        return self._manifest_of(name, self._stats(name))

    def _manifest_of(self, name: str, stats: dict[str, ObjectStat]) -> AdapterManifest | None:
        """The manifest of folder `name` whose used files are listed as `stats`."""
        if not stats:
            return None
        stamp = tuple(sorted((f, s.size, s.tag) for f, s in stats.items()))
        with self._lock:
            known = self._derived.get(name)
        if known is not None and known[0] == stamp:
            return known[1]
        remembered = self.memo.get(name, stamp) if self.memo is not None else None
        if remembered is not None:
            manifest, problem = remembered
        else:
            try:
                manifest, problem = self._derive(name, stats)
            except ObjectMissingError:
                return None  # removed while we read it
            if self.memo is not None:
                self.memo.put(name, stamp, (manifest, problem))
        if problem is not None:
            log.warning(
                "PEFT store %s: adapter folder %r is not served: %s", self.url, name, problem
            )
        with self._lock:
            self._derived[name] = (stamp, manifest, problem)
        return manifest

    def _manifests_of(
        self, listed: dict[str, dict[str, ObjectStat]]
    ) -> list[AdapterManifest | None]:
        """`_manifest_of` every listed folder, by name; folders never derived (a first load) are
        derived DERIVE_WORKERS at a time, as over S3 each one is several round trips."""
        names = sorted(listed)
        with self._lock:
            fresh = [n for n in names if n not in self._derived]
        if len(fresh) > 1:
            with ThreadPoolExecutor(min(DERIVE_WORKERS, len(fresh))) as pool:
                list(pool.map(lambda n: self._manifest_of(n, listed[n]), fresh))
        return [self._manifest_of(n, listed[n]) for n in names]

    def _stats(self, name: str) -> dict[str, ObjectStat]:
        """The folder's used files as listed, reused for `stats_ttl_s` (one catalog load asks
        about a folder several times)."""
        now = time.monotonic()
        with self._lock:
            hit = self._listed.get(name)
        if hit is not None and now - hit[0] < self.stats_ttl_s:
            return hit[1]
        listed = self.inner.list_stats(f"{name}/")
        stats = {f: s for f, s in listed.items() if f in USED_FILES}
        with self._lock:
            self._listed[name] = (now, stats)
        return stats

    def _list_all(self) -> dict[str, dict[str, ObjectStat]]:
        """Every folder's used files from one listing of the prefix (kept for `stats_ttl_s` as
        `_stats` keeps one folder's); a folder whose name is no adapter name is a problem."""
        now = time.monotonic()
        listed = self.inner.list_folder_stats("")
        out = {}
        with self._lock:
            for name, files in listed.items():
                if not NAME_RE.fullmatch(name) or name in {".", ".."}:
                    self._derived[name] = ((), None, BAD_NAME)
                    continue
                out[name] = {f: s for f, s in files.items() if f in USED_FILES}
                self._listed[name] = (now, out[name])
        return out

    def problems(self) -> dict[str, str]:
        """Why each folder seen so far is left out (folder name -> reason)."""
        with self._lock:
            return {n: p for n, (_, _, p) in self._derived.items() if p is not None}

    def _derive(
        self, name: str, stats: dict[str, ObjectStat]
    ) -> tuple[AdapterManifest | None, str | None]:
        missing = [f for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if f not in stats]
        if missing:
            return None, f"lacks {', '.join(missing)}"
        linked = [f for f, s in stats.items() if not s.plain]
        if linked:
            return None, f"{linked[0]} is a symbolic link or has other hard links; copy the file"
        total = sum(s.size for s in stats.values())
        if total > self.max_bytes:
            return None, f"holds {total} bytes, over the {self.max_bytes}-byte limit"
        # Each file is read once, hashed as it arrives: the rulebook and the hash see the same
        # bytes, held in memory up to SPOOL_BYTES and in a temp file beyond.
        sinks: dict[str, HashingWriter] = {}
        with contextlib.ExitStack() as stack:
            for f, listed in stats.items():
                spool = stack.enter_context(
                    tempfile.SpooledTemporaryFile(SPOOL_BYTES, prefix="molora-peft-")
                )
                sinks[f] = HashingWriter(spool)
                # The listed size lets S3 make one GET (no HEAD, no transfer threads).
                self.inner.download(f"{name}/{f}", sinks[f], size=listed.size)  # type: ignore[arg-type]
            total = sum(sink.size for sink in sinks.values())
            if total > self.max_bytes:
                return None, f"holds {total} bytes, over the {self.max_bytes}-byte limit"
            config, weights = sinks[ADAPTER_CONFIG].out, sinks[ADAPTER_WEIGHTS].out
            assert config is not None and weights is not None
            config.seek(0)
            try:
                info = check_adapter_contents(config.read(), weights, sinks[ADAPTER_WEIGHTS].size)
            except InvalidInputError as exc:
                return None, str(exc)
        if not info.base_model:
            return None, f"{ADAPTER_CONFIG} names no base_model_name_or_path"
        entries = [
            FileEntry(path=f, sha256=sink.digest.hexdigest(), size=sink.size)
            for f, sink in sorted(sinks.items())
        ]
        manifest = AdapterManifest(
            name=name,
            version=content_version([(e.path, e.sha256) for e in entries]),
            base_model=info.base_model,
            files=entries,
            blob_dir=BLOB_DIR,
            created=max(s.modified for s in stats.values()),
            description=f"PEFT folder {self.inner.url}/{name}",
            rank=info.rank,
            alpha=info.alpha,
            target_modules=info.target_modules,
            num_layers=info.num_layers,
            dtype=info.dtype,
        )
        return manifest, None

    # ---- the virtual key space -------------------------------------------------------------------

    def _target(self, key: str) -> tuple[AdapterManifest, str | None]:
        """The manifest a key belongs to and the folder file it names (None: the manifest)."""
        parts = key.split("/")
        if len(parts) not in (4, 5) or parts[0] != "adapters":
            raise ObjectMissingError(key)
        manifest = self.current(parts[1])
        if manifest is None or manifest.version != parts[2]:
            raise ObjectMissingError(key)
        if len(parts) == 4 and parts[3] == MANIFEST:
            return manifest, None
        if (
            len(parts) == 5
            and parts[3] == BLOB_DIR
            and parts[4] in {e.path for e in manifest.files}
        ):
            return manifest, f"{manifest.name}/{parts[4]}"
        raise ObjectMissingError(key)

    def read_bytes(self, key: str) -> bytes:
        manifest, inner_key = self._target(key)
        return dump_manifest(manifest) if inner_key is None else self.inner.read_bytes(inner_key)

    def download(
        self, key: str, out: BinaryIO, progress: Progress | None = None, size: int | None = None
    ) -> None:
        manifest, inner_key = self._target(key)
        if inner_key is None:
            out.write(dump_manifest(manifest))
            return
        self.inner.download(inner_key, out, progress, size)

    def download_to(
        self, key: str, path: Path, progress: Progress | None = None, size: int | None = None
    ) -> None:
        manifest, inner_key = self._target(key)
        if inner_key is None:
            path.write_bytes(dump_manifest(manifest))
            return
        self.inner.download_to(inner_key, path, progress, size)

    def _keys(self, manifest: AdapterManifest) -> list[str]:
        vdir = f"adapters/{manifest.name}/{manifest.version}/"
        return [vdir + MANIFEST] + [f"{vdir}{BLOB_DIR}/{e.path}" for e in manifest.files]

    def list_keys(self, prefix: str) -> list[str]:
        if not prefix.startswith("adapters/"):
            return []
        named = prefix[len("adapters/") :].split("/", 1)[0]
        # A catalog load (no name) reads the whole store from one listing.
        manifests = [self.current(named)] if named else self._manifests_of(self._list_all())
        keys = []
        for manifest in manifests:
            if manifest is not None:
                keys += [k for k in self._keys(manifest) if k.startswith(prefix)]
        return sorted(keys)

    def list_children(self, prefix: str) -> list[str]:
        if prefix == "adapters/":
            names = self.inner.list_children("")
            for bad in (n for n in names if not NAME_RE.fullmatch(n)):
                with self._lock:
                    self._derived[bad] = ((), None, BAD_NAME)
            return [n for n in names if NAME_RE.fullmatch(n)]
        parts = prefix.split("/")
        if len(parts) == 3 and parts[0] == "adapters" and parts[2] == "":
            manifest = self.current(parts[1])
            return [] if manifest is None else [manifest.version]
        return []

    def exists(self, key: str) -> bool:
        try:
            self._target(key)
        except ObjectMissingError:
            return False
        return True

    # ---- writes are refused ----------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        raise refuse_write(self.url, WHY, key)

    def upload_file(self, key: str, path: Path, progress: Progress | None = None) -> None:
        raise refuse_write(self.url, WHY, key)

    def delete(self, keys: list[str]) -> None:
        """Removing what is not there changes nothing (a refused upload's cleanup); anything
        else is refused."""
        present = [key for key in keys if self.exists(key)]
        if present:
            raise refuse_write(self.url, WHY, present[0])

    def local_path(self, key: str) -> Path | None:
        """None: even a local folder is read through the verified cache, as it may change."""
        return None
