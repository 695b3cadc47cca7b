"""PEFT folders' derived manifests kept on local disk, keyed by the folder's listing.

Deriving a folder's manifest reads and hashes every byte of it (10,000 folders of 2 MB are
20 GB, minutes of reading). A process that restarts (a router's rolling update, a replica
moved to the node again) finds here every folder whose listed sizes and tags are unchanged and
reads only the others. The memo is a cache: a line that does not parse, or a stamp that differs
from the listing, is a miss. One JSON line per derivation, appended (several processes on a
node may share the file: each line is one `write` on a file opened for appending); the newest
line of a name wins, and the file is rewritten without the superseded lines when they outnumber
the live ones.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path

from adapter_store.manifest import AdapterManifest

log = logging.getLogger(__name__)

Stamp = tuple[tuple[str, int, str], ...]
Derived = tuple[AdapterManifest | None, str | None]  # the manifest, or why the folder is left out
MEMO_DIR = ".peft-derived"  # under the verified cache's root (the cache skips dot folders)


class DerivedMemo:
    """name -> (stamp, manifest or problem), loaded from and appended to one file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[Stamp, Derived]] = {}
        self._lines = 0
        self._load()

    @classmethod
    def for_store(cls, cache_root: Path, store_url: str) -> DerivedMemo:
        """The memo of the PEFT prefix `store_url`, under a cache root."""
        digest = hashlib.sha256(store_url.encode()).hexdigest()[:16]
        return cls(cache_root / MEMO_DIR / f"{digest}.jsonl")

    def get(self, name: str, stamp: Stamp) -> Derived | None:
        with self._lock:
            hit = self._entries.get(name)
        return hit[1] if hit is not None and hit[0] == stamp else None

    def put(self, name: str, stamp: Stamp, derived: Derived) -> None:
        with self._lock:
            self._entries[name] = (stamp, derived)
            self._lines += 1
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a", encoding="utf-8") as out:
                    out.write(_line(name, stamp, derived))
            except OSError as exc:  # a full or read-only disk costs re-derivation only
                log.warning("cannot write the PEFT manifest memo %s: %s", self.path, exc)

    def _load(self) -> None:
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("cannot read the PEFT manifest memo %s: %s", self.path, exc)
            return
        for raw in text.splitlines():
            self._lines += 1
            try:
                item = json.loads(raw)
                stamp: Stamp = tuple((str(f), int(n), str(t)) for f, n, t in item["stamp"])
                manifest = item["manifest"]
                derived: Derived = (
                    None if manifest is None else AdapterManifest.model_validate(manifest),
                    item["problem"],
                )
                self._entries[str(item["name"])] = (stamp, derived)
            except (ValueError, TypeError, KeyError):
                continue  # a torn or foreign line: a miss
        if self._lines > 2 * len(self._entries) + 64:
            self._compact()

    def _compact(self) -> None:
        """Rewrite the file with the newest line of each name (atomically)."""
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        try:
            with tmp.open("w", encoding="utf-8") as out:
                out.writelines(_line(n, st, d) for n, (st, d) in self._entries.items())
            os.replace(tmp, self.path)
            self._lines = len(self._entries)
        except OSError as exc:
            log.warning("cannot compact the PEFT manifest memo %s: %s", self.path, exc)
            tmp.unlink(missing_ok=True)


def _line(name: str, stamp: Stamp, derived: Derived) -> str:
    manifest, problem = derived
    body = None if manifest is None else manifest.model_dump(mode="json")
    item = {"name": name, "stamp": [list(x) for x in stamp], "manifest": body, "problem": problem}
    return json.dumps(item, separators=(",", ":")) + "\n"
