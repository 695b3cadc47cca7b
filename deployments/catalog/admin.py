"""The admin API's store operations: unpublish (yank) and republish (unyank) a name.

Only admin keys reach these, and only for names their tenant may see (public or its own), so
an admin of one tenant cannot touch or even detect another tenant's private names: those
answer the same 404 as a missing name. A name resolves in the caller's namespace first.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from adapter_store.errors import InvalidInputError, NotFoundError
from adapter_store.versions import open_registry
from deployments.catalog import namespaces
from deployments.catalog.model_names import Catalog
from deployments.config import StoreConfig

KINDS: dict[str, Literal["adapter", "composition"]] = {
    "adapters": "adapter",
    "compositions": "composition",
}


class YankBody(BaseModel):
    """Body of `POST /v1/admin/{adapters|compositions}/{name}/{yank|unyank}`."""

    model_config = ConfigDict(extra="forbid")

    version: str | None = Field(None, description="one version; omitted = every version")
    reason: str | None = Field(None, max_length=1000)


class YankResult(BaseModel):
    object: Literal["molora.yank"] = "molora.yank"
    kind: str
    name: str
    action: Literal["yank", "unyank"]
    versions: list[str]


class AdminNotFound(LookupError):
    """The name is missing or not visible to the caller (the same answer for both)."""


def set_yanked(
    store: StoreConfig,
    tenant: str | None,
    collection: str,
    name: str,
    body: YankBody,
    yank: bool,
) -> YankResult:

    kind = KINDS.get(collection)
    if kind is None:
        raise AdminNotFound(f"unknown collection {collection!r}; use adapters or compositions")
    missing = AdminNotFound(f"{kind} {name!r} does not exist")
    registry = open_registry(store.resolved_url(), store.endpoint_url)
    try:
        target = namespaces.find(registry, kind, name, tenant)
    except (InvalidInputError, NotFoundError):
        raise missing from None
    if target is None:
        raise missing
    versions = [v.version for v in target.versions]
    if body.version is not None:
        if body.version not in versions:
            raise AdminNotFound(f"{kind} {name!r} has no version {body.version!r}")
        versions = [body.version]
    for version in versions:
        if yank:
            registry.yank(kind, target.store_name, version, body.reason)
        else:
            registry.unyank(kind, target.store_name, version)
    return YankResult(kind=kind, name=name, action="yank" if yank else "unyank", versions=versions)


def scope_stats(stats: dict[str, Any], visible: Catalog) -> dict[str, Any]:
    """A replica's stats as one tenant's admin may see them: only the adapters its tenant sees
    (public and its own) in `residency`, and `counts` recomputed over those, so another
    tenant's private names and how many of them are resident never appear."""
    names = {entry.name for entry in visible.adapters.values()}
    residency = {
        name: tier
        for name, tier in stats.get("residency", {}).items()
        if name.partition("@")[0] in names
    }
    counts = dict.fromkeys(stats.get("counts", {}), 0)
    for tier in residency.values():
        counts[tier] = counts.get(tier, 0) + 1
    return {**stats, "residency": residency, "counts": counts}
