"""Several stores read as one: the first layer takes every write, the others are read-only.

The default local config uses it so the bundled store in the checkout is never written: runtime
loads and yanks land in the user's data directory, which is searched first. Keys are unioned
(a name's versions in every layer are its versions; a `yanked.json` written on top yanks a
version stored below); a key is read from the first layer holding it.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from adapter_store.backends.base import Backend, ObjectExistsError, ObjectMissingError, Progress
from adapter_store.backends.readonly import refuse_write

LAYER_SEP = "|"


class LayeredBackend:
    def __init__(self, layers: list[Backend]) -> None:
        if len(layers) < 2:
            raise ValueError("a layered store needs at least two layers")
        self.layers = layers
        self.top = layers[0]
        self.lower = layers[1:]
        self.url = LAYER_SEP.join(layer.url for layer in layers)

    def _in_lower(self, key: str) -> bool:
        return any(layer.exists(key) for layer in self.lower)

    def _holder(self, key: str) -> Backend:
        """The first layer holding `key`; the last when none does (its own miss is raised)."""
        return next((layer for layer in self.layers[:-1] if layer.exists(key)), self.layers[-1])

    def read_bytes(self, key: str) -> bytes:
        for layer in self.layers:
            try:
                return layer.read_bytes(key)
            except ObjectMissingError:
                continue
        raise ObjectMissingError(key)

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        if if_absent and self._in_lower(key):
            raise ObjectExistsError(key)
        self.top.put_bytes(key, data, if_absent=if_absent)

    def upload_file(self, key: str, path: Path, progress: Progress | None = None) -> None:
        self.top.upload_file(key, path, progress)

    def download(
        self, key: str, out: BinaryIO, progress: Progress | None = None, size: int | None = None
    ) -> None:
        self._holder(key).download(key, out, progress, size)

    def download_to(
        self, key: str, path: Path, progress: Progress | None = None, size: int | None = None
    ) -> None:
        self._holder(key).download_to(key, path, progress, size)

    def list_keys(self, prefix: str) -> list[str]:
        return sorted({key for layer in self.layers for key in layer.list_keys(prefix)})

    def list_children(self, prefix: str) -> list[str]:
        return sorted({name for layer in self.layers for name in layer.list_children(prefix)})

    def exists(self, key: str) -> bool:
        return any(layer.exists(key) for layer in self.layers)

    def delete(self, keys: list[str]) -> None:
        """Only what the top layer alone holds can go: a key below would stay visible."""
        for key in keys:
            if self._in_lower(key):
                raise refuse_write(
                    next(layer.url for layer in self.lower if layer.exists(key)),
                    "a lower layer of a layered store; yank the version instead",
                    key,
                )
        self.top.delete(keys)

    def local_path(self, key: str) -> Path | None:
        """The file in the first layer holding it, when every layer is a local directory."""
        paths = [layer.local_path(key) for layer in self.layers]
        if any(p is None for p in paths):
            return None
        return next((p for p in paths if p is not None and p.is_file()), paths[0])
