"""Reading a store's versions: list, resolve, fetch (verified) and verify against the rulebook.

Published manifests never change, so each one is memoized after its first read; `forget` drops
one whose files turned out to be gone.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from adapter_store.backends.base import Backend, ObjectMissingError, Progress
from adapter_store.errors import IntegrityError, InvalidInputError, NotFoundError
from adapter_store.layout import MANIFEST, YANKED, AnyManifest, blob_key, kind_prefix, version_dir
from adapter_store.manifest import FileEntry, parse_manifest
from adapter_store.names import Kind, check_name, parse_ref
from adapter_store.staging import HashingWriter
from adapter_store.validate import validate_stored

READ_WORKERS = 16  # manifests a catalog load reads at once


@dataclass
class VersionInfo:
    version: str
    yanked: bool


def _version_infos(prefix: str, keys: set[str]) -> list[VersionInfo]:
    """The versions under a name's `prefix`, from the keys listed there."""
    found = []
    for key in keys:
        version, _, leaf = key[len(prefix) :].partition("/")
        if leaf == MANIFEST:
            found.append(VersionInfo(version, f"{prefix}{version}/{YANKED}" in keys))
    return sorted(found, key=lambda v: v.version)


class VersionReader:
    """The read side of a registry over one backend."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._manifests: dict[tuple[str, str, str], AnyManifest] = {}
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.backend.url

    def names(self, kind: Kind) -> list[str]:
        return self.backend.list_children(kind_prefix(kind))

    def versions(self, kind: Kind, name: str) -> list[VersionInfo]:
        prefix = kind_prefix(kind) + check_name(name) + "/"
        return _version_infos(prefix, set(self.backend.list_keys(prefix)))

    def manifest(self, kind: Kind, name: str, version: str) -> AnyManifest:
        """One version's manifest (memoized: published manifests never change)."""
        memo_key = (kind, name, version)
        with self._lock:
            if memo_key in self._manifests:
                return self._manifests[memo_key]
        key = version_dir(kind, name, version) + MANIFEST
        try:
            data = self.backend.read_bytes(key)
        except ObjectMissingError:
            raise NotFoundError(
                f"{kind} {name}@{version} does not exist in store {self.url}"
            ) from None
        manifest = parse_manifest(data, f"{self.url}/{key}")
        if manifest.kind != kind or manifest.name != name or manifest.version != version:
            raise IntegrityError(
                f"manifest at {self.url}/{key} describes {manifest.kind} {manifest.ref}"
            )
        with self._lock:
            self._manifests[memo_key] = manifest
        return manifest

    def forget(self, kind: Kind, name: str, version: str) -> None:
        with self._lock:
            self._manifests.pop((kind, name, version), None)

    def latest(self, kind: Kind, name: str) -> AnyManifest:
        """Newest created, non-yanked version."""
        return self.latest_and_live(kind, name)[0]

    def latest_and_live(self, kind: Kind, name: str) -> tuple[AnyManifest, list[str]]:
        """The newest created, non-yanked version and every non-yanked version, from one
        listing of the name."""
        return self._latest_and_live(kind, name, self.versions(kind, name))

    def _latest_and_live(
        self, kind: Kind, name: str, infos: list[VersionInfo]
    ) -> tuple[AnyManifest, list[str]]:
        live = [self.manifest(kind, name, v.version) for v in infos if not v.yanked]
        if not live:
            hint = " (all versions are yanked)" if infos else ""
            raise NotFoundError(f"{kind} {name!r} does not exist in store {self.url}{hint}")
        return max(live, key=lambda m: (m.created, m.version)), [m.version for m in live]

    def resolve(self, kind: Kind, ref: str) -> AnyManifest:
        r = parse_ref(ref)
        return (
            self.latest(kind, r.name)
            if r.version is None
            else self.manifest(kind, r.name, r.version)
        )

    def catalog(self, kind: Kind) -> list[AnyManifest]:
        """Latest manifest of every name of this kind (names with only yanked versions omitted)."""
        return [latest for latest, _ in self.catalog_live(kind)]

    def catalog_live(self, kind: Kind) -> list[tuple[AnyManifest, list[str]]]:
        """`latest_and_live` of every name of this kind with a live version, from one listing
        of the kind's keys (over S3, a store of 10,000 adapters is some 30 pages of one LIST,
        not a LIST per name)."""
        prefix = kind_prefix(kind)
        by_name: dict[str, set[str]] = {}
        for key in self.backend.list_keys(prefix):
            name = key[len(prefix) :].partition("/")[0]
            by_name.setdefault(name, set()).add(key)
        named: dict[str, list[VersionInfo]] = {}
        for name, keys in sorted(by_name.items()):
            try:
                named[name] = _version_infos(f"{prefix}{check_name(name)}/", keys)
            except InvalidInputError:
                continue  # a folder that is not a store name
        self._prefetch(kind, named)
        out = []
        for name, infos in named.items():
            try:
                out.append(self._latest_and_live(kind, name, infos))
            except NotFoundError:
                continue  # nothing live
        return out

    def _prefetch(self, kind: Kind, named: dict[str, list[VersionInfo]]) -> None:
        """Read the live manifests not memoized yet READ_WORKERS at a time (a first load over
        S3 is one GET per adapter); a failed read is left to the caller's own read to raise."""
        with self._lock:
            wanted = [
                (name, v.version)
                for name, infos in named.items()
                for v in infos
                if not v.yanked and (kind, name, v.version) not in self._manifests
            ]
        if len(wanted) < 2:
            return

        def read(name_version: tuple[str, str]) -> None:
            with contextlib.suppress(NotFoundError, IntegrityError):
                self.manifest(kind, *name_version)

        with ThreadPoolExecutor(min(READ_WORKERS, len(wanted))) as pool:
            list(pool.map(read, wanted))

    def _missing(self, manifest: AnyManifest, entry: FileEntry) -> NotFoundError:
        """A file of a published version is gone: forget the manifest and say so."""
        self.forget(manifest.kind, manifest.name, manifest.version)
        return NotFoundError(
            f"{manifest.kind} {manifest.ref}: file {entry.path} is missing from store {self.url} "
            "(deleted while reading?)"
        )

    def fetch(
        self,
        manifest: AnyManifest,
        entry: FileEntry,
        out: BinaryIO | None,
        progress: Progress | None = None,
    ) -> None:
        """Stream one file into `out` (or nowhere) and verify its size and sha256."""
        writer = HashingWriter(out)
        try:
            self.backend.download(blob_key(manifest, entry.path), writer, progress, entry.size)  # type: ignore[arg-type]
        except ObjectMissingError:
            raise self._missing(manifest, entry) from None
        writer.check(entry, f"{manifest.kind} {manifest.ref}")

    def fetch_to(
        self, manifest: AnyManifest, entry: FileEntry, path: Path, progress: Progress | None = None
    ) -> None:
        """Download one file to `path`, then verify size and sha256 (and flush it to disk)."""
        try:
            self.backend.download_to(blob_key(manifest, entry.path), path, progress, entry.size)
        except ObjectMissingError:
            raise self._missing(manifest, entry) from None
        writer = HashingWriter()
        with path.open("rb") as fh:
            while block := fh.read(4 * 1024 * 1024):
                writer.write(block)
            os.fsync(fh.fileno())
        writer.check(entry, f"{manifest.kind} {manifest.ref}")

    def verify(self, manifest: AnyManifest, progress: Progress | None = None) -> list[str]:
        """Re-download every file, compare with the manifest, then check the files against the
        rulebook (what a server would refuse); returns the problems found."""
        problems = []
        with tempfile.TemporaryDirectory(prefix="molora-verify-") as tmp:
            for entry in manifest.files:
                try:
                    self.fetch_to(manifest, entry, Path(tmp) / entry.path, progress)
                except (IntegrityError, NotFoundError) as exc:
                    problems.append(str(exc))
            if not problems:
                try:
                    validate_stored(manifest.kind, Path(tmp))
                except InvalidInputError as exc:
                    problems.append(f"{manifest.kind} {manifest.ref} breaks the rules: {exc}")
        return problems

    def owner(self, kind: Kind, name: str) -> str | None:
        """The tenant of a name (every version of a name has the same one); None = public."""
        for info in self.versions(kind, name):
            return self.manifest(kind, name, info.version).tenant
        return None

    def users_of(self, adapter_ref: str) -> list[str]:
        """Composition versions that pin this adapter version."""
        users = []
        for name in self.names("composition"):
            for info in self.versions("composition", name):
                m = self.manifest("composition", name, info.version)
                if adapter_ref in m.adapters:  # type: ignore[union-attr]
                    users.append(m.ref)
        return users
