"""Where the store and the cache are: flag > environment > config file > repo default."""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from adapter_store.backends.base import Backend
from adapter_store.backends.derived_memo import DerivedMemo
from adapter_store.backends.layered import LAYER_SEP, LayeredBackend
from adapter_store.backends.local import LocalBackend
from adapter_store.backends.peft_folder import PeftFolderBackend
from adapter_store.backends.readonly import ReadOnlyBackend
from adapter_store.errors import InvalidInputError

DEFAULT_LOCAL_STORE = Path("deployments/default_store")
DEFAULT_CACHE_BYTES = 20 * 1024**3
PEFT_PREFIX = "peft:"
RO_PREFIX = "ro:"


class StoreSettings(BaseModel):
    """Optional `$MOLORA_HOME/store.json`: defaults for every `molora` command and the runtime."""

    model_config = ConfigDict(extra="forbid")

    store: str | None = Field(None, description="s3://bucket/prefix or a directory")
    endpoint_url: str | None = None
    cache_dir: Path | None = None
    cache_bytes: int = Field(DEFAULT_CACHE_BYTES, ge=0)


def molora_home() -> Path:
    """The one root of MoLoRA's caches (models, store cache, settings): `$MOLORA_HOME`, else
    `$XDG_CACHE_HOME/molora`, else `~/.cache/molora`."""
    if env := os.environ.get("MOLORA_HOME"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "molora"


def molora_data_dir() -> Path:
    """User data that must outlive any cache (adapters loaded at runtime): `$MOLORA_HOME/data`
    when MOLORA_HOME is set (one root), else `$XDG_DATA_HOME/molora`, else
    `~/.local/share/molora`."""
    if env := os.environ.get("MOLORA_HOME"):
        return Path(env).expanduser() / "data"
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base).expanduser() / "molora"


def user_store_dir() -> Path:
    """The writable store layered over the bundled one by the default local config."""
    return molora_data_dir() / "store"


def load_settings() -> StoreSettings:
    path = Path(os.environ.get("MOLORA_STORE_CONFIG") or molora_home() / "store.json")
    if not path.is_file():
        return StoreSettings()
    try:
        return StoreSettings.model_validate(json.loads(path.read_text()))
    except (ValidationError, json.JSONDecodeError) as exc:
        raise InvalidInputError(f"invalid store settings file {path}: {exc}") from exc


def resolve_store_url(flag: str | None = None, settings: StoreSettings | None = None) -> str:
    """`--store`, then `MOLORA_STORE`, then the settings file, then ./deployments/default_store."""
    for candidate in (flag, os.environ.get("MOLORA_STORE"), (settings or load_settings()).store):
        if candidate:
            return candidate
    if DEFAULT_LOCAL_STORE.is_dir():
        return str(DEFAULT_LOCAL_STORE)
    raise InvalidInputError(
        "no store configured: pass --store s3://bucket/prefix or a directory, or set MOLORA_STORE"
    )


def resolve_cache_dir(
    flag: str | Path | None = None, settings: StoreSettings | None = None
) -> Path:
    settings = settings or load_settings()
    chosen = flag or os.environ.get("MOLORA_STORE_CACHE") or settings.cache_dir
    return Path(chosen).expanduser() if chosen else molora_home() / "store-cache"


def resolve_cache_bytes(flag: int | None = None, settings: StoreSettings | None = None) -> int:
    if flag is not None:
        return flag
    env = os.environ.get("MOLORA_STORE_CACHE_BYTES")
    if env:
        try:
            return int(env)
        except ValueError:
            raise InvalidInputError(f"MOLORA_STORE_CACHE_BYTES={env!r} is not an integer") from None
    return (settings or load_settings()).cache_bytes


def open_backend(
    url: str,
    endpoint_url: str | None = None,
    *,
    create: bool = False,
    cache_root: Path | None = None,
) -> Backend:
    """`s3://bucket/prefix` → S3Backend; anything else is a local directory path. Three forms
    compose them: `peft:<dir or s3 url>` (a read-only folder of PEFT adapters), `ro:<url>` (a
    store read but never written) and `TOP|LOWER|...` (layers: writes go to TOP, which is
    created if it is a missing directory; the others are read-only). `cache_root`: where a
    `peft:` store keeps its derived manifests across restarts (none: in memory only)."""
    if LAYER_SEP in url:
        parts = [part.strip() for part in url.split(LAYER_SEP)]
        if not all(parts):
            raise InvalidInputError(f"store URL {url!r} has an empty layer")
        top = open_backend(parts[0], endpoint_url, create=True)
        lower = [
            ReadOnlyBackend(
                open_backend(part, endpoint_url, cache_root=cache_root),
                "a lower layer of a layered store",
            )
            for part in parts[1:]
        ]
        return LayeredBackend([top, *lower])
    if url.startswith(RO_PREFIX):
        inner = open_backend(url[len(RO_PREFIX) :], endpoint_url, cache_root=cache_root)
        return ReadOnlyBackend(inner, "opened with ro:")
    if url.startswith(PEFT_PREFIX):
        inner_url = url[len(PEFT_PREFIX) :]
        if inner_url.startswith((PEFT_PREFIX, RO_PREFIX)) or not inner_url:
            raise InvalidInputError(
                f"store URL {url!r}: peft: takes a directory or s3://bucket/prefix"
            )
        folders = open_backend(inner_url, endpoint_url)
        memo = None
        if cache_root is not None:
            memo = DerivedMemo.for_store(cache_root, f"{endpoint_url or ''}|{folders.url}")
        return PeftFolderBackend(folders, memo=memo)  # type: ignore[arg-type]
    if url.startswith("s3://"):
        parsed = urlparse(url)
        if "@" in parsed.netloc or ":" in parsed.netloc:
            raise InvalidInputError(
                "store URL must be s3://bucket/prefix; credentials and ports do not belong in it "
                "(use the AWS credential chain and --endpoint-url)"
            )
        if not parsed.netloc:
            raise InvalidInputError(
                f"store URL {url!r} lacks a bucket: expected s3://bucket/prefix"
            )

        from adapter_store.backends.s3 import S3Backend  # boto3 only for S3 stores

        return S3Backend(parsed.netloc, parsed.path.strip("/"), endpoint_url=endpoint_url)
    if "://" in url:
        raise InvalidInputError(
            f"unsupported store URL {url!r}: use s3://bucket/prefix or a directory"
        )

    return LocalBackend(url, create=create)
