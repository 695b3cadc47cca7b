"""The small object interface the registry needs; both backends implement exactly this."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import BinaryIO, Protocol

Progress = Callable[[int], None]
"""Called with the number of bytes just transferred."""


@dataclass(frozen=True)
class ObjectStat:
    """What a listing says about one object: enough to notice that its content changed."""

    size: int
    tag: str  # ETag, or inode/mtime of a local file
    modified: datetime
    plain: bool = True  # False: a local symlink or a file with other hard links


class ObjectMissingError(KeyError):
    """Internal: the key does not exist (the registry turns it into NotFoundError)."""


class ObjectExistsError(Exception):
    """Internal: a conditional put lost because the key already exists."""


class Backend(Protocol):
    url: str

    def read_bytes(self, key: str) -> bytes: ...

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        """Write an object; with `if_absent`, raise ObjectExistsError if the key exists."""
        ...

    def upload_file(self, key: str, path: Path, progress: Progress | None = None) -> None: ...

    def download(
        self, key: str, out: BinaryIO, progress: Progress | None = None, size: int | None = None
    ) -> None:
        """Stream the object, in order, into `out.write` (`size`, if known, saves a HEAD)."""
        ...

    def download_to(
        self, key: str, path: Path, progress: Progress | None = None, size: int | None = None
    ) -> None:
        """Write the object to `path` (which the caller owns and removes on failure)."""
        ...

    def list_keys(self, prefix: str) -> list[str]:
        """Every key under `prefix` (recursive), relative to the store root."""
        ...

    def list_children(self, prefix: str) -> list[str]:
        """Names of the immediate sub-folders of `prefix` (which ends with '/')."""
        ...

    def exists(self, key: str) -> bool: ...

    def delete(self, keys: list[str]) -> None: ...

    def local_path(self, key: str) -> Path | None:
        """The file behind a key when the store is a local directory, else None."""
        ...
