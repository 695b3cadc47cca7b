"""Publishing in two steps: files uploaded and hashed, then one conditional manifest write."""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from adapter_store.backends.base import Backend, ObjectExistsError
from adapter_store.errors import IntegrityError, StoreError, VersionExistsError
from adapter_store.layout import MANIFEST, AnyManifest, version_dir
from adapter_store.manifest import FileEntry, dump_manifest, utcnow
from adapter_store.validate import sha256_file

log = logging.getLogger(__name__)


class HashingWriter:
    """Write-through sink that counts and hashes what passes (for verify-while-download)."""

    def __init__(self, out: BinaryIO | None = None) -> None:
        self.out = out
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        if self.out is not None:
            self.out.write(data)
        return len(data)

    def check(self, entry: FileEntry, ref: str) -> None:
        if self.size != entry.size or self.digest.hexdigest() != entry.sha256:
            raise IntegrityError(
                f"{ref}: {entry.path} failed verification (expected {entry.size} bytes sha256 "
                f"{entry.sha256[:12]}…, got {self.size} bytes sha256 {self.digest.hexdigest()[:12]}…): "
                "the stored object is corrupted or was modified"
            )


@dataclass
class StagedPublish:
    """Files uploaded, manifest not yet written: `commit()` publishes, `abort()` cleans up."""

    backend: Backend
    manifest: AnyManifest
    uploaded: list[str] = field(default_factory=list)
    done: bool = False

    def commit(self) -> AnyManifest:
        m = self.manifest
        key = version_dir(m.kind, m.name, m.version) + MANIFEST
        try:
            self.backend.put_bytes(key, dump_manifest(m), if_absent=True)
        except ObjectExistsError:
            self.abort()
            raise VersionExistsError(
                f"{m.kind} {m.ref} already exists (published concurrently); versions are "
                "immutable, choose a new version"
            ) from None
        except BaseException:
            self.abort()
            raise
        self.done = True
        return m

    def abort(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            self.backend.delete(self.uploaded)
        except StoreError as exc:  # the store went away: say what is left behind
            log.error("could not remove partial upload %s: %s", self.uploaded, exc)


def file_entries(files: list[Path]) -> tuple[list[FileEntry], dict[str, Path]]:
    """Each file's manifest entry (name, sha256, size), and where to upload it from."""
    entries = [FileEntry(path=p.name, sha256=sha256_file(p), size=p.stat().st_size) for p in files]
    return entries, {p.name: p for p in files}


def new_blob_dir() -> str:
    """A fresh folder name per publish, so a losing concurrent publish never touches the winner's."""
    return f"u-{int(time.time() * 1000):x}-{secrets.token_hex(6)}"


def manifest_fields(
    name: str,
    version: str,
    entries: list[FileEntry],
    description: str | None,
    tags: list[str] | None,
    tenant: str | None,
) -> dict[str, Any]:
    """The manifest fields every kind shares, with a fresh blob folder and timestamp."""
    return {
        "name": name, "version": version, "files": entries, "blob_dir": new_blob_dir(),
        "created": utcnow(), "description": description, "tags": tags or [], "tenant": tenant,
    }  # fmt: skip
