"""What this process wrote to the store, so the next catalog epoch bump can name it.

The admin API's writes (yank, unyank, runtime load and unload: deployments/catalog/admin.py and
lora_admin.py) record each store name they touched here, from whatever thread they run in. The
router's `CatalogWatch.changed` (deployments/catalog/watch.py) takes the pending names and bumps
the epoch with them, so every router re-reads only those names instead of the whole store.

A process-wide journal rather than a return value: the ingress calls `changed()` without
arguments after a write, and several writes may be in flight at once; taking everything pending
covers the caller's own write whichever bump carries it (see `CatalogWatch.changed`).
"""

from __future__ import annotations

import threading
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict

Kind = Literal["adapter", "composition"]
# Past this many pending names a bump asks for a full reload instead (a bulk operation).
MAX_PENDING = 512


class ChangedName(BaseModel):
    """One store name a change touched: routers re-read its versions from the store."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Kind
    name: str  # the store name (a tenant's own names are namespaced: `acme~n0`)
    versions: tuple[str, ...] = ()  # the versions the write touched (logs; not trusted as state)

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.name


class Journal:
    """Pending changed names with a sequence number per record (thread-safe)."""

    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str], ChangedName] = {}
        self._overflow = False
        self._oldest: float | None = None  # monotonic time of the oldest pending record
        self._max = max_pending
        self.seq = 0  # records ever made; `take` reports the last one it covers

    def record(self, kind: Kind, name: str, versions: tuple[str, ...] | list[str] = ()) -> None:
        with self._lock:
            self.seq += 1
            key = (kind, name)
            old = self._pending.get(key)
            merged = tuple(dict.fromkeys((*(old.versions if old else ()), *versions)))
            self._pending[key] = ChangedName(kind=kind, name=name, versions=merged)
            if len(self._pending) > self._max:
                self._overflow = True
            if self._oldest is None:
                self._oldest = time.monotonic()

    def take(self) -> tuple[int, list[ChangedName] | None]:
        """(the sequence number covered, the pending names); None for the names means reload
        everything (more than `max_pending` piled up)."""
        with self._lock:
            names = None if self._overflow else list(self._pending.values())
            self._pending.clear()
            self._overflow = False
            self._oldest = None
            return self.seq, names

    def put_back(self, names: list[ChangedName] | None) -> None:
        """Names a failed bump took: pending again, for the next bump (None: a full reload)."""
        if names is None:
            with self._lock:
                self._overflow = True
                self._oldest = self._oldest or time.monotonic()
            return
        for n in names:
            self.record(n.kind, n.name, n.versions)

    def age(self) -> float:
        """Seconds the oldest pending record has waited (0 when none is pending)."""
        with self._lock:
            return 0.0 if self._oldest is None else time.monotonic() - self._oldest


JOURNAL = Journal()


def record(kind: Kind, name: str, versions: tuple[str, ...] | list[str] = ()) -> None:
    """Note that `kind` `name` (a store name) changed in the store (call after the write)."""
    JOURNAL.record(kind, name, versions)
