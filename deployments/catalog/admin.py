"""The admin API's store operations: unpublish (yank) and republish (unyank) a name.

Only admin keys reach these, and only for names their tenant may see (public or its own), so
an admin of one tenant cannot touch or even detect another tenant's private names: those
answer the same 404 as a missing name. A name resolves in the caller's namespace first.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from adapter_store.errors import InvalidInputError, NotFoundError
from adapter_store.layout import YANKED, version_dir
from adapter_store.manifest import YankRecord, utcnow
from adapter_store.names import Kind
from adapter_store.versions import Registry
from deployments.catalog import journal, namespaces
from deployments.catalog.model_names import Catalog
from deployments.catalog.store import writer
from deployments.config import StoreConfig
from deployments.protocol.errors import status_of

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


class AdminFailed(Exception):
    """The store failed during a yank or unyank: answered with `status` (503 carries
    Retry-After). The message says whether anything stayed changed: the writes made are undone
    first, so normally nothing did."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def set_yanked(
    store: StoreConfig,
    tenant: str | None,
    collection: str,
    name: str,
    body: YankBody,
    yank: bool,
) -> YankResult:
    """Yank (or unyank) one version or every version of a name, all or nothing: when a store
    write fails, the ones this call made are undone before `AdminFailed` is raised, so a failed
    call leaves the name as it was (the rare exception, an undo that fails too, is named in
    the message). Every name written is recorded for the catalog epoch's next bump."""
    kind = KINDS.get(collection)
    if kind is None:
        raise AdminNotFound(f"unknown collection {collection!r}; use adapters or compositions")
    missing = AdminNotFound(f"{kind} {name!r} does not exist")
    action = "yank" if yank else "unyank"
    try:
        registry = writer(store)
        target = namespaces.find(registry, kind, name, tenant)
    except (InvalidInputError, NotFoundError):
        raise missing from None
    except Exception as exc:  # the store down or refusing: nothing was written
        raise _failed(exc, f"{action} {kind} {name!r}: nothing was changed") from None
    if target is None:
        raise missing
    versions = [v.version for v in target.versions]
    if body.version is not None:
        if body.version not in versions:
            raise AdminNotFound(f"{kind} {name!r} has no version {body.version!r}")
        versions = [body.version]
    was_yanked = {v.version for v in target.versions if v.yanked}
    done: list[tuple[str, bytes | None]] = []  # (version, its yank record before; None: live)
    try:
        for version in versions:
            before = _record(registry, kind, target.store_name, version, version in was_yanked)
            # Listed before the write: a write that raised may still have landed.
            done.append((version, before))
            if yank:
                registry.yank(kind, target.store_name, version, body.reason)
            else:
                registry.unyank(kind, target.store_name, version)
    except Exception as exc:
        left = _undo(registry, kind, target.store_name, done)
        state = (
            "nothing was changed"
            if not left
            else f"could not undo the {action} of {left}: those versions may stay {action}ed"
        )
        raise _failed(exc, f"{action} {kind} {name!r}: {state}") from None
    finally:
        if done:
            journal.record(kind, target.store_name, [v for v, _ in done])
    return YankResult(kind=kind, name=name, action=action, versions=versions)


def _marker(kind: Kind, store_name: str, version: str) -> str:
    return version_dir(kind, store_name, version) + YANKED


def _record(
    registry: Registry, kind: Kind, store_name: str, version: str, yanked: bool
) -> bytes | None:
    """A yanked version's yank record (reason and time), to put back on undo; None if live."""
    if not yanked:
        return None
    try:
        return registry.backend.read_bytes(_marker(kind, store_name, version))
    except Exception:  # yanked a moment ago but unreadable now: undo writes a new record
        record = YankRecord(yanked=utcnow(), reason="restored after a failed admin call")
        return record.model_dump_json().encode()


def _undo(
    registry: Registry, kind: Kind, store_name: str, done: list[tuple[str, bytes | None]]
) -> list[str]:
    """Put each version of `done` back as it was; returns the versions that could not be."""
    left = []
    for version, before in reversed(done):
        try:
            if before is None:
                registry.backend.delete([_marker(kind, store_name, version)])
            else:
                registry.backend.put_bytes(_marker(kind, store_name, version), before)
        except Exception:
            left.append(version)
    return left


def _failed(exc: Exception, what: str) -> AdminFailed:
    """The store's failure as an answer: 503 unreachable, 502 garbled or refused, 403 a
    read-only store, 500 anything else (never a bare one)."""
    status = status_of(exc)
    status = 500 if status in (400, 404) else status  # the name was checked; this is the store
    return AdminFailed(status, f"{what}; the store failed: {type(exc).__name__}: {exc}")


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
