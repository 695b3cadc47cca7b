"""The one place `deployments` talks to the adapter store: listing and adapter sources.

A router keeps one `CatalogLoader` for its life, so each reload only lists the store: manifests
already read (and a PEFT folder's derived manifest, while its files are unchanged) are reused,
and a reload of a store of thousands of adapters costs listings, not downloads and hashes. A
change re-reads only the names it touched (`CatalogLoader.entries`): one listing each."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from adapter_store import open_store
from adapter_store.config import load_settings, resolve_cache_dir
from adapter_store.errors import NotFoundError
from adapter_store.layout import AnyManifest
from adapter_store.versions import Registry, open_registry
from deployments.catalog import rank_hints
from deployments.catalog.model_names import AdapterEntry, Catalog, CompositionEntry, NameKey
from deployments.config import StoreConfig
from molora_runtime.lora.source import AdapterSource

_WRITERS_LOCK = threading.Lock()
E = TypeVar("E", AdapterEntry, CompositionEntry)


def _registry(cfg: StoreConfig) -> Registry:
    """The catalog's registry: a `peft:` store keeps derived manifests in the cache dir, so a
    restarted router reads only the folders that changed."""
    cache_root = resolve_cache_dir(cfg.cache_dir, load_settings())
    return open_registry(cfg.resolved_url(), cfg.endpoint_url, cache_root=cache_root)


_WRITERS: dict[tuple[str, str | None], Registry] = {}


def writer(cfg: StoreConfig) -> Registry:
    """The registry the admin API writes through, opened once per store and process: opening
    one builds an S3 client, which cost more CPU than the write itself under load."""
    key = (cfg.resolved_url(), cfg.endpoint_url)
    with _WRITERS_LOCK:
        registry = _WRITERS.get(key)
        if registry is None:
            registry = _WRITERS[key] = open_registry(*key)
        return registry


class CatalogLoader:
    """Loads the catalog over one registry kept open across reloads."""

    def __init__(self, cfg: StoreConfig) -> None:
        self.cfg = cfg
        self._registry: Registry | None = None
        # The entries the last load built (a name gone from the store is dropped with it).
        self._built: dict[NameKey, tuple[AnyManifest, list[str], Any]] = {}
        self._last = self._built
        self.cpu_s = 0.0  # the last load's CPU time in its thread (what a reload takes a core)

    def _open(self) -> Registry:
        if self._registry is None:
            self._registry = _registry(self.cfg)
        return self._registry

    def __call__(self) -> Catalog:
        """Adapters and compositions of the store (latest, non-yanked versions) for
        `/v1/models`; their ranks also go to this process's request router
        (deployments/catalog/rank_hints.py)."""
        registry = self._open()  # opened once: its price is not a reload's
        started = time.thread_time()
        try:
            return self._load(registry)
        finally:
            self.cpu_s = time.thread_time() - started

    def _load(self, registry: Registry) -> Catalog:
        self._last, self._built = self._built, {}
        adapters: dict[str, AdapterEntry] = {}
        for manifest, live in registry.catalog_live("adapter"):
            adapters[manifest.name] = self._entry(manifest, live, _adapter_entry)
        compositions: dict[str, CompositionEntry] = {}
        for manifest, live in registry.catalog_live("composition"):
            compositions[manifest.name] = self._entry(manifest, live, _composition_entry)
        rank_hints.publish({e.name: e.rank for e in adapters.values() if e.rank is not None})
        return Catalog(adapters=adapters, compositions=compositions)

    def _entry(self, manifest: AnyManifest, live: list[str], make: Callable[..., E]) -> E:
        """`make(manifest, live)`, reused from the last load while the name's latest manifest
        and live versions are the same (a reload of 10,000 adapters builds none)."""
        key = (manifest.kind, manifest.name)
        known = self._last.get(key)
        if known is None or known[0] is not manifest or known[1] != live:
            known = (manifest, live, make(manifest, live))
        self._built[key] = known
        return known[2]  # type: ignore[no-any-return]

    def entries(
        self, keys: Iterable[NameKey]
    ) -> dict[NameKey, AdapterEntry | CompositionEntry | None]:
        """Only these names, read from the store now: each one's entry, or None when it has
        no live version (all yanked, or gone). Store failures raise: a change must not be
        confirmed on a name that could not be read."""
        registry = self._open()
        out: dict[NameKey, AdapterEntry | CompositionEntry | None] = {}
        for kind, name in keys:
            try:
                manifest, live = registry.latest_and_live(kind, name)
            except NotFoundError:
                out[(kind, name)] = None
                continue
            if kind == "adapter":
                out[(kind, name)] = _adapter_entry(manifest, live)
            else:
                out[(kind, name)] = _composition_entry(manifest, live)
        rank_hints.update(
            {
                name: (entry.rank if isinstance(entry, AdapterEntry) else None)
                for (kind, name), entry in out.items()
                if kind == "adapter"
            }
        )
        return out


def _adapter_entry(manifest: AnyManifest, live: list[str]) -> AdapterEntry:
    return AdapterEntry(
        name=manifest.name,
        versions=tuple(live),
        latest=manifest.version,
        base_model=manifest.base_model,
        tenant=manifest.tenant,
        rank=manifest.rank,
    )


def _composition_entry(manifest: AnyManifest, live: list[str]) -> CompositionEntry:
    return CompositionEntry(
        name=manifest.name,
        adapters=tuple(manifest.adapters),
        versions=tuple(live),
        latest=manifest.version,
        base_model=manifest.base_model,
        top_k=manifest.top_k,
        tenant=manifest.tenant,
    )


def load_catalog(cfg: StoreConfig) -> Catalog:
    """One catalog load over a registry opened for it."""
    return CatalogLoader(cfg)()


def open_source(cfg: StoreConfig) -> AdapterSource:
    """An `AdapterSource` over the store with its verified local cache (one per replica)."""
    return open_store(
        cfg.resolved_url(),
        cfg.endpoint_url,
        cache_dir=cfg.cache_dir,
        cache_bytes=cfg.cache_bytes,
    )
