"""A store in a plain directory (e.g. `deployments/default_store` committed in the repo).

Writes go to a temp file and are renamed into place; a conditional put uses `os.link`, which
fails atomically when the target exists, so concurrent publishers get the same guarantee as
S3's `If-None-Match: *`.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO

from adapter_store.backends.base import (
    ObjectExistsError,
    ObjectMissingError,
    ObjectStat,
    Progress,
)
from adapter_store.errors import InvalidInputError, StoreUnavailableError, disk_full

CHUNK = 4 * 1024 * 1024


class LocalBackend:
    def __init__(self, root: str | Path, *, create: bool = False) -> None:
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)
        self._inside = os.path.join(self.url, "")
        if create:
            self.root.mkdir(parents=True, exist_ok=True)

    def _check_root(self) -> None:
        if not self.root.is_dir():
            raise StoreUnavailableError(f"store directory {self.root} does not exist")

    def _path(self, key: str) -> Path:
        joined = os.path.join(self.url, key)
        if ".." in key.split("/") or not (joined == self.url or joined.startswith(self._inside)):
            raise InvalidInputError(f"key {key!r} escapes the store root")
        return Path(joined)

    def read_bytes(self, key: str) -> bytes:
        self._check_root()
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectMissingError(key) from None

    def _write_tmp(self, dest: Path, write: object) -> Path:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=dest.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                write(fh)  # type: ignore[operator]
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            Path(tmp).unlink(missing_ok=True)
            raise (disk_full(exc, f"local store {self.root}: writing {dest.name}") or exc) from exc
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return Path(tmp)

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self._check_root()
        dest = self._path(key)
        tmp = self._write_tmp(dest, lambda fh: fh.write(data))
        try:
            if if_absent:
                try:
                    os.link(tmp, dest)
                except FileExistsError:
                    raise ObjectExistsError(key) from None
            else:
                os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def upload_file(self, key: str, path: Path, progress: Progress | None = None) -> None:
        self._check_root()
        dest = self._path(key)

        def copy(fh: BinaryIO) -> None:
            with Path(path).open("rb") as src:
                while block := src.read(CHUNK):
                    fh.write(block)
                    if progress:
                        progress(len(block))

        tmp = self._write_tmp(dest, copy)
        os.replace(tmp, dest)

    def download(
        self, key: str, out: BinaryIO, progress: Progress | None = None, size: int | None = None
    ) -> None:
        self._check_root()
        try:
            src = self._path(key).open("rb")
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectMissingError(key) from None
        with src:
            while block := src.read(CHUNK):
                out.write(block)
                if progress:
                    progress(len(block))

    def download_to(
        self, key: str, path: Path, progress: Progress | None = None, size: int | None = None
    ) -> None:
        with path.open("wb") as out:
            self.download(key, out, progress, size)

    def list_keys(self, prefix: str) -> list[str]:
        """Every file under `prefix`, as keys (a catalog load lists a whole store at once)."""
        self._check_root()
        base = self._path(prefix)
        if not base.is_dir():
            return []
        start = len(self._inside)
        keys = []
        for folder, _, files in os.walk(base):
            inside = os.path.join(folder, "")[start:]
            keys += [inside + f for f in files if not f.startswith(".tmp-")]
        return sorted(keys)

    def list_children(self, prefix: str) -> list[str]:
        self._check_root()
        base = self._path(prefix)
        if not base.is_dir():
            return []
        return sorted(p.name for p in base.iterdir() if p.is_dir())

    def list_stats(self, prefix: str) -> dict[str, ObjectStat]:
        """Files directly under `prefix` (a folder key ending in '/'), by name, from `lstat`."""
        self._check_root()
        base = self._path(prefix)
        return {} if base.is_symlink() else _files_in(base)

    def list_folder_stats(self, prefix: str) -> dict[str, dict[str, ObjectStat]]:
        """`list_stats` of every folder directly under `prefix`, by folder name (a symlinked
        folder is left out)."""
        self._check_root()
        base = self._path(prefix)
        try:
            entries = os.scandir(base)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        with entries:
            folders = [e.path for e in entries if e.is_dir(follow_symlinks=False)]
        return {os.path.basename(path): _files_in(path) for path in folders}

    def exists(self, key: str) -> bool:
        self._check_root()
        return self._path(key).is_file()

    def delete(self, keys: list[str]) -> None:
        self._check_root()
        parents: set[Path] = set()
        for key in keys:
            path = self._path(key)
            path.unlink(missing_ok=True)
            parents.add(path.parent)
        # Drop folders left empty, deepest first, never the root itself.
        for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            while parent != self.root and parent.is_dir() and not any(parent.iterdir()):
                shutil.rmtree(parent, ignore_errors=True)
                parent = parent.parent

    def local_path(self, key: str) -> Path | None:
        return self._path(key)


def _files_in(folder: str | Path) -> dict[str, ObjectStat]:
    """The files directly in `folder` by name, one `scandir` (a catalog reload lists every
    folder of a store)."""
    out = {}
    try:
        entries = os.scandir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    with entries:
        for entry in entries:
            if entry.name.startswith(".tmp-"):
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed while listed
            if stat.S_ISDIR(info.st_mode):
                continue
            out[entry.name] = ObjectStat(
                size=info.st_size,
                tag=f"{info.st_ino}-{info.st_mtime_ns}-{info.st_size}",
                modified=datetime.fromtimestamp(info.st_mtime, UTC),
                plain=stat.S_ISREG(info.st_mode) and info.st_nlink == 1,
            )
    return out
