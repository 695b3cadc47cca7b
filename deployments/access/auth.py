"""API keys: creation, the hashed key file, and O(1) constant-time verification.

A key is `mlr_<key_id>_<secret>`: `key_id` (12 hex) is public and indexes the key file, the
secret (256 random bits) is never stored, only `scrypt(key, salt)`. Verification looks the id
up, recomputes the hash and compares in constant time; a verified key is remembered as a SHA-256
digest (never the key) so the slow hash runs once per key and process, not once per request.

The key file (JSON or YAML: `{"keys": [{key_id, tenant, admin, salt, hash, kdf, created}]}`) is
read from `server.auth.keys_file` (a Kubernetes Secret mounted as a file works the same way) or
from the environment variable `server.auth.keys_env`, and re-read when it changes so keys can be
rotated without a restart. No module here imports Ray, so the CLI can use it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import re
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from adapter_store.names import check_tenant
from deployments.config import AuthConfig

KEY_PREFIX = "mlr"
KEY_RE = re.compile(r"mlr_([0-9a-f]{12})_([A-Za-z0-9_-]{32,128})")
KDF = "scrypt-n16384-r8-p1"
_SCRYPT = {"n": 2**14, "r": 8, "p": 1, "maxmem": 64 * 2**20, "dklen": 32}


class KeyEntry(BaseModel):
    """One stored key: who it belongs to and its salted hash (never the key)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key_id: str = Field(pattern=r"^[0-9a-f]{12}$")
    tenant: str
    admin: bool = False
    salt: str = Field(pattern=r"^[0-9a-f]{32}$")
    hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    kdf: Literal["scrypt-n16384-r8-p1"] = KDF
    created: datetime | None = None

    _tenant = field_validator("tenant")(classmethod(lambda cls, v: check_tenant(v)))


class KeyFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[KeyEntry] = Field(default_factory=list)

    @field_validator("keys")
    @classmethod
    def _unique(cls, keys: list[KeyEntry]) -> list[KeyEntry]:
        ids = [k.key_id for k in keys]
        if len(ids) != len(set(ids)):
            raise ValueError("duplicate key_id in the key file")
        return keys


class KeyFileError(ValueError):
    """The key file is missing or invalid (the message never contains key material)."""


@dataclass(frozen=True)
class Principal:
    """Who is calling: a key's id, its tenant and whether it may administer the store."""

    key_id: str
    tenant: str | None
    admin: bool = False


ANONYMOUS = Principal(key_id="anonymous", tenant=None, admin=False)


def _hash(key: str, salt: bytes) -> str:
    return hashlib.scrypt(key.encode(), salt=salt, **_SCRYPT).hex()


def new_key(tenant: str, admin: bool = False) -> tuple[str, KeyEntry]:
    """A fresh key (shown once) and the entry to store for it."""
    check_tenant(tenant)
    key_id = secrets.token_hex(6)
    key = f"{KEY_PREFIX}_{key_id}_{secrets.token_urlsafe(32)}"
    salt = secrets.token_bytes(16)
    entry = KeyEntry(
        key_id=key_id,
        tenant=tenant,
        admin=admin,
        salt=salt.hex(),
        hash=_hash(key, salt),
        created=datetime.now(UTC),
    )
    return key, entry


def parse_key_file(text: str, where: str) -> KeyFile:
    try:
        data = yaml.safe_load(text) if text.strip() else {}
        return KeyFile.model_validate(data or {})
    except (yaml.YAMLError, ValidationError) as exc:
        # pydantic errors quote input values: report only the locations and messages.
        if isinstance(exc, ValidationError):
            detail = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
            )
        else:
            detail = "not valid YAML/JSON"
        raise KeyFileError(f"key file {where} is invalid: {detail}") from None


def read_key_file(path: Path) -> KeyFile:
    if not path.exists():
        return KeyFile()
    return parse_key_file(path.read_text(), str(path))


def write_key_file(path: Path, keys: KeyFile) -> None:
    """Atomically replace `path` (mode 0600): a crash never leaves half a key file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = keys.model_dump_json(indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def bearer_key(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header, or None."""
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


class KeyRing:
    """The loaded key file, re-read when its source changes; verifies presented keys."""

    def __init__(self, cfg: AuthConfig, root: Path | None = None) -> None:
        self.cfg = cfg
        self._path = None
        if cfg.keys_file:
            path = Path(cfg.keys_file).expanduser()
            self._path = path if path.is_absolute() or root is None else root / path
        self._entries: dict[str, KeyEntry] = {}
        self._verified: dict[str, bytes] = {}  # key_id -> sha256(key) of a key already verified
        self._stamp: object = None
        self._checked = 0.0
        self._lock = threading.Lock()
        self._slow_gate = asyncio.Semaphore(2)
        self._load()

    def _source(self) -> tuple[object, str, str]:
        if self._path is not None:
            stat = self._path.stat()  # a missing file fails loudly at start
            stamp = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
            if stamp == self._stamp:
                return stamp, "", str(self._path)
            return stamp, self._path.read_text(), str(self._path)
        text = os.environ.get(self.cfg.keys_env or "", "")
        if not text:
            raise KeyFileError(f"environment variable {self.cfg.keys_env} is empty or unset")
        return hashlib.sha256(text.encode()).digest(), text, f"${self.cfg.keys_env}"

    def _load(self) -> None:
        stamp, text, where = self._source()
        self._checked = time.monotonic()
        if stamp == self._stamp:
            return
        entries = {e.key_id: e for e in parse_key_file(text, where).keys}
        with self._lock:
            # Forget verifications of keys that were removed or re-hashed (revocation).
            self._verified = {
                k: v for k, v in self._verified.items() if entries.get(k) == self._entries.get(k)
            }
            self._entries, self._stamp = entries, stamp

    def _maybe_reload(self) -> None:
        if time.monotonic() - self._checked < self.cfg.reload_s:
            return
        try:
            self._load()
        except (OSError, KeyFileError):
            self._checked = time.monotonic()  # keep the last good keys; try again later

    def __len__(self) -> int:
        return len(self._entries)

    def _fast(self, key: str | None) -> Principal | KeyEntry | None:
        """Everything but the slow hash: a principal or None when decided, else the entry
        whose hash must be checked."""
        if not key:
            return None
        match = KEY_RE.fullmatch(key)
        if match is None:
            return None
        self._maybe_reload()
        entry = self._entries.get(match.group(1))
        if entry is None:
            return None
        known = self._verified.get(entry.key_id)
        if known is None:
            return entry
        ok = hmac.compare_digest(hashlib.sha256(key.encode()).digest(), known)
        return _principal(entry) if ok else None

    def _slow(self, key: str, entry: KeyEntry) -> Principal | None:
        if not hmac.compare_digest(_hash(key, bytes.fromhex(entry.salt)), entry.hash):
            return None
        with self._lock:
            if self._entries.get(entry.key_id) == entry:
                self._verified[entry.key_id] = hashlib.sha256(key.encode()).digest()
        return _principal(entry)

    def verify(self, key: str | None) -> Principal | None:
        """The key's principal, or None for a missing, malformed, unknown or wrong key."""
        found = self._fast(key)
        if isinstance(found, KeyEntry):
            return self._slow(key, found)  # type: ignore[arg-type]
        return found

    async def verify_async(self, key: str | None) -> Principal | None:
        """`verify` without blocking the event loop: the slow hash (first use of a key in this
        process, or a guess at a known key id) runs in a thread, at most two at a time, so
        guesses cost bounded CPU and never stall other requests."""
        found = self._fast(key)
        if not isinstance(found, KeyEntry):
            return found
        async with self._slow_gate:
            return await asyncio.to_thread(self._slow, key, found)  # type: ignore[arg-type]


def _principal(entry: KeyEntry) -> Principal:
    return Principal(key_id=entry.key_id, tenant=entry.tenant, admin=entry.admin)


def dump_entry_json(entry: KeyEntry) -> str:
    """An entry as one JSON line (for `keys list --json`), without salt or hash."""
    return json.dumps(
        {"key_id": entry.key_id, "tenant": entry.tenant, "admin": entry.admin,
         "created": entry.created.isoformat() if entry.created else None}
    )  # fmt: skip
