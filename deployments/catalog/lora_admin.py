"""vLLM-compatible runtime LoRA admin: `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`.

Operators used to vLLM send `{"lora_name", "lora_path"}` and `{"lora_name"}`. Here loading
*publishes* to the adapter store (validated by the store's rulebook against the served base
model), so every replica and router sees it, and unloading yanks every version of the name.

Names are per tenant: a tenant's `lora_name` is published as `tenant~lora_name` (a name it
already owned from before keeps its place), so it never meets another tenant's name.
`lora_path` is either a store reference, `store:NAME[@VERSION]` (its files are republished
under `lora_name`; the same name unyanks that version), or a folder inside
`server.runtime_lora.load_dir`. Without that setting loading from paths is refused (403). A path
is resolved (symlinks followed) and must stay inside the directory; the folder's files are then
read through a directory descriptor with O_NOFOLLOW (a symlink inside is refused, so swapping
one in after the check cannot escape; a file with other hard links is refused too), copied, and the copy is what is validated and published.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from adapter_store.errors import InvalidInputError, NotFoundError
from adapter_store.validate import DEFAULT_MAX_BYTES
from adapter_store.versions import Registry
from deployments.catalog import journal, namespaces
from deployments.catalog.store import writer
from deployments.config import StoreConfig

STORE_PREFIX = "store:"
MAX_FILES = 16


class LoadLoraBody(BaseModel):
    """vLLM's `LoadLoRAAdapterRequest`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = Field(False, description="replace an adapter of the same name")


class UnloadLoraBody(BaseModel):
    """vLLM's `UnloadLoRAAdapterRequest`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: int | None = Field(None, description="accepted for vLLM clients; unused")


class LoraAdminError(Exception):
    """Answered in the OpenAI error shape with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class LoraResult(BaseModel):
    object: Literal["molora.lora_adapter"] = "molora.lora_adapter"
    action: Literal["load", "unload"]
    name: str
    versions: list[str]
    message: str


def _outside(param: str = "lora_path") -> LoraAdminError:
    return LoraAdminError(
        400, "lora_path must name an adapter folder inside server.runtime_lora.load_dir", param
    )


def resolve_inside(root: Path, given: str) -> Path:
    """`given` (relative to `root`, or absolute) resolved; it must be a folder inside `root`.
    Missing and outside answer the same, so the endpoint reveals nothing about other paths."""
    if "\x00" in given:
        raise _outside()
    root_real = root.resolve(strict=True)
    candidate = Path(given)
    candidate = candidate if candidate.is_absolute() else root_real / candidate
    try:
        real = candidate.resolve(strict=True)
    except (OSError, RuntimeError):
        raise _outside() from None
    if real == root_real or not real.is_relative_to(root_real) or not real.is_dir():
        raise _outside()
    return real


def copy_folder(folder: Path, dest: Path, max_bytes: int) -> None:
    """Copy the regular files of `folder` into `dest` without following any symlink."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    dfd = os.open(folder, flags | getattr(os, "O_DIRECTORY", 0))
    try:
        names = os.listdir(dfd)
        if len(names) > MAX_FILES:
            raise LoraAdminError(400, f"the adapter folder holds more than {MAX_FILES} entries")
        total = 0
        for name in names:
            try:
                fd = os.open(name, flags, dir_fd=dfd)
            except OSError:
                raise LoraAdminError(
                    400, f"{name!r} in the adapter folder is a symlink or unreadable", "lora_path"
                ) from None
            with os.fdopen(fd, "rb") as src:
                info = os.fstat(src.fileno())
                if stat.S_ISDIR(info.st_mode):
                    continue  # PEFT folders have no sub-folders we use
                if not stat.S_ISREG(info.st_mode):
                    raise LoraAdminError(400, f"{name!r} is not a regular file", "lora_path")
                if info.st_nlink > 1:  # a hard link may be another tenant's file
                    raise LoraAdminError(
                        400, f"{name!r} has other hard links; copy the file instead", "lora_path"
                    )
                total += info.st_size
                if total > max_bytes:
                    raise LoraAdminError(400, f"the adapter folder exceeds {max_bytes} bytes")
                with (dest / name).open("wb") as out:
                    while block := src.read(4 * 1024 * 1024):
                        out.write(block)
    finally:
        os.close(dfd)


def _next_version(existing: list[str]) -> str:
    n = len(existing) + 1
    while f"v{n}" in existing:
        n += 1
    return f"v{n}"


def load_lora(
    store: StoreConfig,
    load_dir: Path | None,
    base_config: dict[str, object] | None,
    tenant: str | None,
    body: LoadLoraBody,
) -> LoraResult:
    """Publish `body.lora_path` as `body.lora_name` in the caller's namespace (see
    deployments/catalog/namespaces.py and the module docstring). The name is recorded for the
    catalog epoch's next bump once a write to it was attempted (even one that failed)."""
    name = body.lora_name
    registry = writer(store)
    try:
        target = namespaces.write_target(registry, "adapter", name, tenant)
    except InvalidInputError as exc:
        raise LoraAdminError(400, str(exc), "lora_name") from None
    if target is None:  # a tenant's plain name, named by a caller without a tenant
        raise LoraAdminError(400, f"the adapter name {name!r} is not available", "lora_name")
    key, live = target.store_name, target.live
    if live and not body.load_inplace:
        raise LoraAdminError(400, f"the LoRA adapter {name!r} has already been loaded", "lora_name")
    existing = [v.version for v in target.versions]
    # A name keeps its owner (public, or the caller's own tenant) for good.
    publish_tenant = registry.owner("adapter", key) if existing else tenant
    writes: list[str] = []  # versions of `key` a write was attempted on
    try:
        return _publish(registry, load_dir, base_config, tenant, body, target, writes,
                        publish_tenant)  # fmt: skip
    finally:
        if writes:
            journal.record("adapter", key, writes)


def _publish(
    registry: Registry,
    load_dir: Path | None,
    base_config: dict[str, object] | None,
    tenant: str | None,
    body: LoadLoraBody,
    target: namespaces.Target,
    writes: list[str],
    publish_tenant: str | None,
) -> LoraResult:
    """`load_lora`'s writes; each version is added to `writes` before it is written."""
    name, key, live = body.lora_name, target.store_name, target.live
    existing = [v.version for v in target.versions]
    try:
        if body.lora_path.startswith(STORE_PREFIX):
            ref = body.lora_path[len(STORE_PREFIX) :]
            src_name, _, src_version = ref.partition("@")
            missing = LoraAdminError(404, f"store adapter {ref!r} does not exist", "lora_path")
            try:
                source = namespaces.find(registry, "adapter", src_name, tenant)
                if source is None:
                    raise missing
                at = f"@{src_version}" if src_version else ""
                manifest = registry.resolve("adapter", f"{source.store_name}{at}")
            except (NotFoundError, InvalidInputError):
                raise missing from None
            if manifest.name == key:
                writes.append(manifest.version)
                registry.unyank("adapter", key, manifest.version)
                if body.load_inplace:  # in place: the named version is the only live one
                    for other in live:
                        if other != manifest.version:
                            writes.append(other)
                            registry.yank("adapter", key, other, "replaced by load_lora_adapter")
                return LoraResult(
                    action="load", name=name, versions=[manifest.version],
                    message=f"Success: LoRA adapter '{name}' added successfully.",
                )  # fmt: skip
            with tempfile.TemporaryDirectory(prefix="molora-lora-") as tmp:
                for entry in manifest.files:
                    registry.fetch_to(manifest, entry, Path(tmp) / entry.path)
                version = _next_version(existing)
                writes.append(version)
                registry.publish_adapter(
                    tmp, key, version, base_config=base_config, tenant=publish_tenant
                )
        else:
            if load_dir is None:
                raise LoraAdminError(
                    403,
                    "loading adapters from paths is disabled: set server.runtime_lora.load_dir, "
                    "or pass lora_path 'store:NAME[@VERSION]'",
                    "lora_path",
                )
            folder = resolve_inside(load_dir, body.lora_path)
            with tempfile.TemporaryDirectory(prefix="molora-lora-") as tmp:
                copy_folder(folder, Path(tmp), DEFAULT_MAX_BYTES)
                version = _next_version(existing)
                writes.append(version)
                registry.publish_adapter(
                    tmp, key, version, base_config=base_config, tenant=publish_tenant
                )
    except InvalidInputError as exc:  # the rulebook's verdict on the adapter
        raise LoraAdminError(400, f"invalid LoRA adapter: {exc}", "lora_path") from None
    if body.load_inplace:
        for old in live:
            writes.append(old)
            registry.yank("adapter", key, old, "replaced by load_lora_adapter")
    return LoraResult(
        action="load", name=name, versions=[version],
        message=f"Success: LoRA adapter '{name}' added successfully.",
    )  # fmt: skip


def unload_lora(store: StoreConfig, tenant: str | None, body: UnloadLoraBody) -> LoraResult:
    """Yank every live version of `body.lora_name` as the caller's namespace resolves it."""
    name = body.lora_name
    missing = LoraAdminError(404, f"the LoRA adapter {name!r} cannot be found", "lora_name")
    registry = writer(store)
    try:
        target = namespaces.find(registry, "adapter", name, tenant)
    except InvalidInputError:
        raise missing from None
    if target is None or not target.live:
        raise missing
    try:
        for version in target.live:
            registry.yank("adapter", target.store_name, version, "unload_lora_adapter")
    finally:
        journal.record("adapter", target.store_name, target.live)
    return LoraResult(
        action="unload", name=name, versions=target.live,
        message=f"Success: LoRA adapter '{name}' removed successfully.",
    )  # fmt: skip
