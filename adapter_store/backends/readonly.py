"""A store that may be read but never written: lower layers, `ro:` URLs, PEFT-folder views.

Reads pass through; every write raises `ReadOnlyStoreError` naming the store and why, before
anything is changed.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from adapter_store.backends.base import Backend, Progress
from adapter_store.errors import ReadOnlyStoreError


def refuse_write(url: str, why: str, key: str) -> ReadOnlyStoreError:
    """The one wording of a refused write (push, yank, unyank, delete, runtime load)."""
    return ReadOnlyStoreError(
        f"store {url} is read-only ({why}); cannot write {key}: push, yank and runtime loads go "
        "to a writable store (store.writable in the serve config, or --store)"
    )


class ReadOnlyBackend:
    """Wraps any backend; reads are the inner backend's, writes are refused."""

    def __init__(self, inner: Backend, why: str) -> None:
        self.inner = inner
        self.why = why
        self.url = inner.url

    def read_bytes(self, key: str) -> bytes:
        return self.inner.read_bytes(key)

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        raise refuse_write(self.url, self.why, key)

    def upload_file(self, key: str, path: Path, progress: Progress | None = None) -> None:
        raise refuse_write(self.url, self.why, key)

    def download(
        self, key: str, out: BinaryIO, progress: Progress | None = None, size: int | None = None
    ) -> None:
        self.inner.download(key, out, progress, size)

    def download_to(
        self, key: str, path: Path, progress: Progress | None = None, size: int | None = None
    ) -> None:
        self.inner.download_to(key, path, progress, size)

    def list_keys(self, prefix: str) -> list[str]:
        return self.inner.list_keys(prefix)

    def list_children(self, prefix: str) -> list[str]:
        return self.inner.list_children(prefix)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def delete(self, keys: list[str]) -> None:
        """Removing what is not there changes nothing (a refused upload's cleanup); anything
        else is refused."""
        present = [key for key in keys if self.exists(key)]
        if present:
            raise refuse_write(self.url, self.why, present[0])

    def local_path(self, key: str) -> Path | None:
        return self.inner.local_path(key)
