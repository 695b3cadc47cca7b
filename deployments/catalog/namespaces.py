"""Which store name a caller's adapter name means: its own namespace first, then a plain name.

A tenant's adapters live under `tenant~name` (see adapter_store/names.py), so two tenants may
both call an adapter `foo` and neither can learn the other's names by trying them: the store is
only ever asked about the caller's own namespace and about plain names it may see (public, or
its own from before namespaces). Another tenant's name is never read as a candidate target, so
every answer for it is the answer for a name that does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapter_store.names import check_plain_name, namespaced


@dataclass(frozen=True)
class Target:
    """A caller's name resolved in the store: `store_name` and its versions (maybe none)."""

    store_name: str
    versions: list[Any]  # adapter_store VersionInfo

    @property
    def live(self) -> list[str]:
        return [v.version for v in self.versions if not v.yanked]


def _visible_plain(registry: Any, kind: str, name: str, tenant: str | None) -> Target | None:
    """`name` as a plain store name, when it exists and is public or `tenant`'s own."""
    infos = registry.versions(kind, name)
    if not infos or registry.owner(kind, name) not in (None, tenant):
        return None
    return Target(name, infos)


def find(registry: Any, kind: str, name: str, tenant: str | None) -> Target | None:
    """The existing store name `name` means for `tenant`, or None (missing or not visible)."""
    check_plain_name(name)
    if tenant is not None:
        infos = registry.versions(kind, namespaced(tenant, name))
        if infos:
            return Target(namespaced(tenant, name), infos)
    return _visible_plain(registry, kind, name, tenant)


def write_target(registry: Any, kind: str, name: str, tenant: str | None) -> Target | None:
    """Where `tenant` publishes `name`: its namespace (or a plain name it already owns); without
    a tenant, the public plain name. None when a public caller names a tenant's plain name."""
    check_plain_name(name)
    if tenant is None:
        infos = registry.versions(kind, name)
        if infos and registry.owner(kind, name) is not None:
            return None
        return Target(name, infos)
    own = registry.versions(kind, namespaced(tenant, name))
    if own:
        return Target(namespaced(tenant, name), own)
    legacy = registry.versions(kind, name)
    if legacy and registry.owner(kind, name) == tenant:
        return Target(name, legacy)
    return Target(namespaced(tenant, name), [])
