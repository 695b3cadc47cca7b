"""The one place `deployments` talks to the adapter store: listing and adapter sources.

A router keeps one `CatalogLoader` for its life, so each reload only lists the store: manifests
already read (and a PEFT folder's derived manifest, while its files are unchanged) are reused,
and a reload of a store of thousands of adapters costs listings, not downloads and hashes."""

from __future__ import annotations

from adapter_store import open_store
from adapter_store.versions import Registry, open_registry
from deployments.catalog import rank_hints
from deployments.catalog.model_names import AdapterEntry, Catalog, CompositionEntry
from deployments.config import StoreConfig
from molora_runtime.lora.source import AdapterSource


def _registry(cfg: StoreConfig) -> Registry:
    return open_registry(cfg.resolved_url(), cfg.endpoint_url)


class CatalogLoader:
    """Loads the catalog over one registry kept open across reloads."""

    def __init__(self, cfg: StoreConfig) -> None:
        self.cfg = cfg
        self._registry: Registry | None = None

    def __call__(self) -> Catalog:
        """Adapters and compositions of the store (latest, non-yanked versions) for
        `/v1/models`; their ranks also go to this process's request router
        (deployments/catalog/rank_hints.py)."""
        if self._registry is None:
            self._registry = _registry(self.cfg)
        registry = self._registry
        adapters: dict[str, AdapterEntry] = {}
        for manifest, live in registry.catalog_live("adapter"):
            adapters[manifest.name] = AdapterEntry(
                name=manifest.name,
                versions=tuple(live),
                latest=manifest.version,
                base_model=manifest.base_model,
                tenant=manifest.tenant,
                rank=manifest.rank,
            )
        compositions: dict[str, CompositionEntry] = {}
        for manifest, live in registry.catalog_live("composition"):
            compositions[manifest.name] = CompositionEntry(
                name=manifest.name,
                adapters=tuple(manifest.adapters),
                versions=tuple(live),
                latest=manifest.version,
                base_model=manifest.base_model,
                top_k=manifest.top_k,
                tenant=manifest.tenant,
            )
        rank_hints.publish({e.name: e.rank for e in adapters.values() if e.rank is not None})
        return Catalog(adapters=adapters, compositions=compositions)


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
