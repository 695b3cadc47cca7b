"""adapter_store: versioned LoRA adapters and learned compositions over S3 or a local directory.

Publishing validates and uploads files, then commits with a conditional manifest write; the
runtime reads through `AdapterStoreSource`, a verified, LRU-bounded local cache.
"""

from adapter_store.cache import LocalCache
from adapter_store.config import open_backend, resolve_store_url
from adapter_store.errors import (
    DiskFullError,
    IntegrityError,
    InvalidInputError,
    NotFoundError,
    StoreAccessError,
    StoreError,
    StoreUnavailableError,
    VersionExistsError,
)
from adapter_store.manifest import AdapterManifest, CompositionManifest, FileEntry
from adapter_store.names import Ref, parse_ref
from adapter_store.source import AdapterStoreSource
from adapter_store.versions import Registry, open_registry


def open_store(
    url: str | None = None, endpoint_url: str | None = None, **kwargs: object
) -> AdapterStoreSource:
    """The runtime's entry point: a source over `url` (or the configured default store)."""
    return AdapterStoreSource(url, endpoint_url=endpoint_url, **kwargs)  # type: ignore[arg-type]


__all__ = [
    "AdapterManifest",
    "AdapterStoreSource",
    "CompositionManifest",
    "DiskFullError",
    "FileEntry",
    "IntegrityError",
    "InvalidInputError",
    "LocalCache",
    "NotFoundError",
    "Ref",
    "Registry",
    "StoreAccessError",
    "StoreError",
    "StoreUnavailableError",
    "VersionExistsError",
    "open_backend",
    "open_registry",
    "open_store",
    "parse_ref",
    "resolve_store_url",
]
