"""Route identity: what a prefix's KV depends on besides its tokens (the prefix-cache key).

Two prompts may share KV blocks only if every weight that touched those tokens was the same: the
base model, each adapter's exact files (name@version *and* the sha256 of its weights and config, so
two versions under one name never collide), the mix weights, the vocab table, and for learned
routes the composition (its files: gates and config), its experts, top-k and temperature. The
base route's identity is the base model alone, so every base request shares its blocks. A request's tenant and `cache_salt`
salt the identity (`cache_identity`), so one tenant's prompts never hit another's blocks.

`RouteIdentities.identity` and `chain_block_hash` are the key; file digests are cached by
(path, size, mtime) so admitting a request hashes nothing it hashed before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from molora_runtime.errors import AdapterLoadError
from molora_runtime.lora.composition import (
    CompositionConfig,
    CompositionError,
    read_composition_config,
)
from molora_runtime.lora.source import AdapterSource
from molora_runtime.routes import RouteSpec


def cache_identity(route_identity: bytes, tenant: str | None, cache_salt: str | None) -> bytes:
    """A request's prefix-cache key: its route identity, salted with its tenant and `cache_salt`
    (each length-prefixed, so no two different pairs collide); with neither, the route identity
    alone."""
    if tenant is None and cache_salt is None:
        return route_identity
    h = hashlib.sha256(route_identity)
    for part in (tenant, cache_salt):
        data = b"" if part is None else part.encode()
        h.update(b"\0" if part is None else b"\1")
        h.update(len(data).to_bytes(8, "little") + data)
    return h.digest()


def chain_block_hash(parent: bytes | None, identity: bytes, token_ids: Sequence[int]) -> bytes:
    """sha256 over (parent block's hash, route identity, this block's token ids)."""
    h = hashlib.sha256()
    h.update(parent or b"\0" * 32)
    h.update(identity)
    h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in token_ids))
    return h.digest()


class RouteIdentities:
    """Computes (and caches) the identity digest of routes over one base model and source."""

    def __init__(self, base_model: str, source: AdapterSource) -> None:
        self.base = base_model
        self.source = source
        self._files: dict[tuple[str, int, int], str] = {}

    def _folder_digest(self, folder: Path) -> str:
        """sha256 over every file of an adapter or composition folder (names and bytes)."""
        parts = []
        for path in sorted(p for p in Path(folder).iterdir() if p.is_file()):
            st = path.stat()
            key = (str(path), st.st_size, st.st_mtime_ns)
            digest = self._files.get(key)
            if digest is None:
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                self._files[key] = digest
            parts.append(f"{path.name}={digest}")
        return ",".join(parts)

    def adapter_key(self, ref: str | None) -> str:
        """An adapter's key text: its ref and its files' digest; `base` for None."""
        if ref is None:
            return "base"
        folder = self.source.adapter_path(ref)
        if not Path(folder).is_dir():
            raise AdapterLoadError(f"adapter {ref!r}: folder {folder} does not exist")
        try:
            return f"{ref}#{self._folder_digest(folder)}"
        except OSError as exc:
            raise AdapterLoadError(f"adapter {ref!r}: cannot read its files: {exc}") from exc

    def composition_key(self, ref: str) -> tuple[str, CompositionConfig]:
        """A composition's key text (its ref and its files' digest: gates and config) and its
        config, whose experts, top-k and temperature the route's key also names."""
        folder = self.source.composition_path(ref)
        try:
            cfg = read_composition_config(ref, folder)
            digest = self._folder_digest(folder)
        except (OSError, CompositionError) as exc:
            raise AdapterLoadError(f"composition {ref!r}: {exc}") from exc
        return f"{ref}#{digest}", cfg

    def describe(self, route: RouteSpec) -> str:
        """The canonical text the identity digests (readable in tests and logs)."""
        return f"model={self.base};kind={route.kind}{route.key_text(self)}"

    def identity(self, route: RouteSpec) -> bytes:
        return hashlib.sha256(self.describe(route).encode()).digest()
