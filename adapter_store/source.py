"""`AdapterStoreSource`: what the runtime holds; turns `name[@version]` into a verified local folder.

A pinned ref that is already cached costs no network call. A bare name resolves `latest`
(memoized for `latest_ttl_s`); if the store is down, the newest cached version serves, with a
warning. A local-directory store is read in place after checksum verification.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from adapter_store.backends.base import Progress
from adapter_store.cache import LocalCache
from adapter_store.config import (
    load_settings,
    open_backend,
    resolve_cache_bytes,
    resolve_cache_dir,
    resolve_store_url,
)
from adapter_store.errors import IntegrityError, NotFoundError, StoreUnavailableError
from adapter_store.layout import MANIFEST, AnyManifest, blob_key, kind_prefix
from adapter_store.names import Kind, parse_ref
from adapter_store.validate import sha256_file
from adapter_store.versions import Registry

log = logging.getLogger(__name__)


class AdapterStoreSource:
    """Implements the runtime's `AdapterSource` protocol (structurally, without importing it)."""

    def __init__(
        self,
        store_url: str | None = None,
        cache_dir: str | Path | None = None,
        endpoint_url: str | None = None,
        cache_bytes: int | None = None,
        *,
        latest_ttl_s: float = 10.0,
        direct_local: bool = True,
        registry: Registry | None = None,
    ) -> None:
        settings = load_settings()
        root = resolve_cache_dir(cache_dir, settings)
        if registry is None:
            url = resolve_store_url(store_url, settings)
            endpoint = endpoint_url or settings.endpoint_url
            registry = Registry(open_backend(url, endpoint, cache_root=root))
        self.registry = registry
        self.cache = LocalCache(root, resolve_cache_bytes(cache_bytes, settings))
        self.latest_ttl_s = latest_ttl_s
        self.direct_local = direct_local
        self._latest: dict[tuple[str, str], tuple[float, AnyManifest]] = {}
        self._verified: dict[Path, tuple[int, int]] = {}
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.registry.url

    # ---- the AdapterSource protocol --------------------------------------------------------------

    def adapter_path(self, ref: str) -> Path:
        return self.path("adapter", ref)

    def composition_path(self, ref: str) -> Path:
        return self.path("composition", ref)

    def check_adapter(self, ref: str) -> None:
        """Raise as `adapter_path` would for an unknown adapter, without downloading it: a
        request is validated at once and its files are fetched by the background workers."""
        r = parse_ref(ref)
        if r.version is not None:
            if self._is_local or self.cache.get("adapter", r.name, r.version) is None:
                try:
                    self.registry.manifest("adapter", r.name, r.version)
                except StoreUnavailableError as exc:
                    raise StoreUnavailableError(
                        f"adapter {ref} is not cached and the store is down: {exc}"
                    ) from exc
            return
        try:
            self.latest("adapter", r.name)
        except StoreUnavailableError as exc:
            if not self.cache.cached_manifests("adapter", r.name):
                raise StoreUnavailableError(
                    f"cannot resolve the latest adapter {r.name!r}: the store is down and no "
                    f"version is cached ({exc})"
                ) from exc

    def adapter_identity(self, ref: str) -> str | None:
        """The base-model identity recorded when `ref` was pushed (None if not recorded)."""
        manifest = self.manifest("adapter", ref)
        return getattr(manifest, "base_model_identity", None)

    # ---- resolution ------------------------------------------------------------------------------

    def path(self, kind: Kind, ref: str, progress: Progress | None = None) -> Path:
        r = parse_ref(ref)
        if r.version is not None:
            if not self._is_local:
                cached = self.cache.get(kind, r.name, r.version)
                if cached is not None:
                    self.cache.count(hits=1)
                    return cached
            try:
                manifest = self.registry.manifest(kind, r.name, r.version)
            except StoreUnavailableError as exc:
                raise StoreUnavailableError(
                    f"{kind} {ref} is not cached and the store is down: {exc}"
                ) from exc
            return self.materialize(manifest, progress)
        try:
            manifest = self.latest(kind, r.name)
        except StoreUnavailableError as exc:
            return self._offline_latest(kind, r.name, exc)
        return self.materialize(manifest, progress)

    def latest(self, kind: Kind, name: str) -> AnyManifest:
        key = (kind, name)
        now = time.monotonic()
        with self._lock:
            hit = self._latest.get(key)
        if hit is not None and now - hit[0] < self.latest_ttl_s:
            return hit[1]
        manifest = self.registry.latest(kind, name)
        with self._lock:
            self._latest[key] = (now, manifest)
        return manifest

    def manifest(self, kind: Kind, ref: str) -> AnyManifest:
        r = parse_ref(ref)
        return (
            self.latest(kind, r.name)
            if r.version is None
            else self.registry.manifest(kind, r.name, r.version)
        )

    def _offline_latest(self, kind: Kind, name: str, exc: StoreUnavailableError) -> Path:
        cached = self.cache.cached_manifests(kind, name)
        if not cached:
            raise StoreUnavailableError(
                f"cannot resolve the latest {kind} {name!r}: the store is down and no version is "
                f"cached ({exc})"
            ) from exc
        newest = max(cached, key=lambda m: (m.created, m.version))
        log.warning("store %s is down (%s); serving cached %s %s", self.url, exc, kind, newest.ref)
        entry = self.cache.get(kind, newest.name, newest.version)
        if entry is None:
            raise StoreUnavailableError(
                f"store is down and cached {kind} {newest.ref} was just evicted"
            ) from exc
        return entry

    @property
    def _is_local(self) -> bool:
        return self.direct_local and self.registry.backend.local_path("x") is not None

    def materialize(self, manifest: AnyManifest, progress: Progress | None = None) -> Path:
        """A verified local folder for this exact version (cache pull or in-place local store)."""
        if self._is_local:
            self.cache.count(hits=1)  # a local store is read in place: already on disk
            return self._verified_local(manifest)
        cached = self.cache.get(manifest.kind, manifest.name, manifest.version, manifest)
        if cached is not None:
            self.cache.count(hits=1)
            return cached
        self.cache.count(misses=1)
        return self.cache.pull(self.registry, manifest, progress)

    # ---- the disk tier, for the runtime's tier metrics -------------------------------------------

    def pin(self, ref: str) -> None:
        """Keep every cached version of adapter `ref` through cache eviction."""
        self.cache.pin("adapter", parse_ref(ref).name)

    def on_disk(self, ref: str) -> bool:
        """Whether a version of adapter `ref` is already on local disk (no download needed)."""
        if self._is_local:
            return True
        r = parse_ref(ref)
        base = self.cache.root / kind_prefix("adapter") / r.name
        versions = [base / r.version] if r.version else (base.glob("*") if base.is_dir() else [])
        return any((v / MANIFEST).is_file() for v in versions)

    def disk_tier(self) -> dict[str, int | list[str] | None]:
        """Counters, bytes, budget and the adapters on local disk (read by the hot-set)."""
        c = self.cache.counters
        local = self._is_local
        return {
            "hits": c.hits,
            "misses": c.misses,
            "loads": c.loads,
            "evictions": c.evictions,
            "bytes": 0 if local else self.cache.usage_cached(),
            "capacity_bytes": None if local else self.cache.max_bytes,
            "adapters": [] if local else self.cache.cached_names("adapter"),
        }

    def _verified_local(self, manifest: AnyManifest) -> Path:
        folder = None
        for entry in manifest.files:
            path = self.registry.backend.local_path(blob_key(manifest, entry.path))
            assert path is not None
            folder = path.parent
            try:
                st = path.stat()
            except FileNotFoundError:
                raise NotFoundError(
                    f"{manifest.kind} {manifest.ref}: {entry.path} is missing from the store"
                ) from None
            stamp = (st.st_size, st.st_mtime_ns)
            with self._lock:
                if self._verified.get(path) == stamp:
                    continue
            if st.st_size != entry.size or sha256_file(path) != entry.sha256:
                raise IntegrityError(
                    f"{manifest.kind} {manifest.ref}: {entry.path} in {path.parent} does not match "
                    "its manifest checksum (corrupted or modified)"
                )
            with self._lock:
                self._verified[path] = stamp
        assert folder is not None
        return folder
