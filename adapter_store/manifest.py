"""Version manifests: the immutable record a reader trusts (files, checksums, shapes, lineage).

A manifest is written last, with a conditional put, so its presence is the commit of a version.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from adapter_store.errors import IntegrityError
from adapter_store.names import check_name, check_tenant, check_version, parse_ref

MANIFEST_FORMAT = 1
SHA256_RE = r"^[0-9a-f]{64}$"
FILE_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class FileEntry(BaseModel):
    """One stored file of a version."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(pattern=FILE_NAME_RE, description="file name inside the version folder")
    sha256: str = Field(pattern=SHA256_RE)
    size: int = Field(ge=0)


class _Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    manifest_format: int = MANIFEST_FORMAT
    name: str
    version: str
    base_model: str = Field(min_length=1, description="base model id the weights belong to")
    files: list[FileEntry] = Field(min_length=1)
    blob_dir: str = Field(
        pattern=r"^u-[0-9a-z-]{8,64}$",
        description="sub-folder holding this publish's files (unique per upload attempt)",
    )
    created: datetime
    description: str | None = Field(None, max_length=4000)
    tags: list[str] = Field(default_factory=list, max_length=64)
    tenant: str | None = Field(
        None,
        description="owning tenant: only its API keys see and use this name; None = public",
    )

    _name = field_validator("name")(classmethod(lambda cls, v: check_name(v)))
    _tenant = field_validator("tenant")(
        classmethod(lambda cls, v: v if v is None else check_tenant(v))
    )
    _version = field_validator("version")(classmethod(lambda cls, v: check_version(v)))

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, path: str) -> FileEntry:
        for entry in self.files:
            if entry.path == path:
                return entry
        raise IntegrityError(f"{self.ref}: manifest lists no file {path!r}")


class AdapterManifest(_Manifest):
    """A PEFT LoRA adapter version."""

    kind: Literal["adapter"] = "adapter"
    base_model_fingerprint: str | None = Field(
        None,
        pattern=SHA256_RE,
        description="sha256 of the base model's canonical config.json, when given on push",
    )
    base_model_identity: str | None = Field(
        None,
        pattern=SHA256_RE,
        description="base_model.base_identity of the base config given on push (the architecture "
        "fields that decide every shape); servers refuse the adapter on a different base",
    )
    rank: int = Field(ge=1)
    alpha: float
    target_modules: list[str] = Field(min_length=1)
    num_layers: int = Field(ge=1, description="decoder layers the adapter touches (max index+1)")
    dtype: str


class CompositionManifest(_Manifest):
    """A learned composition version: K adapters pinned to versions plus per-layer gates."""

    kind: Literal["composition"] = "composition"
    adapters: list[str] = Field(min_length=1, description="pinned `name@version` refs, gate order")
    top_k: int = Field(ge=1)
    temperature: float = Field(gt=0)
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)

    @field_validator("adapters")
    @classmethod
    def _pinned(cls, refs: list[str]) -> list[str]:
        for ref in refs:
            if parse_ref(ref).version is None:
                raise ValueError(f"composition adapter {ref!r} is not pinned to a version")
        return refs


Manifest = Annotated[AdapterManifest | CompositionManifest, Field(discriminator="kind")]
_MANIFEST_ADAPTER: TypeAdapter[AdapterManifest | CompositionManifest] = TypeAdapter(Manifest)


def parse_manifest(data: bytes, where: str) -> AdapterManifest | CompositionManifest:
    """Parse stored manifest bytes; a broken manifest is an integrity problem of the store."""
    try:
        return _MANIFEST_ADAPTER.validate_python(json.loads(data))
    except (ValueError, TypeError) as exc:
        raise IntegrityError(f"manifest at {where} is unreadable: {exc}") from exc


def dump_manifest(manifest: AdapterManifest | CompositionManifest) -> bytes:
    # A public manifest is written without `tenant`, byte-identical to what older readers know.
    exclude = {"tenant"} if manifest.tenant is None else None
    return (manifest.model_dump_json(indent=2, exclude=exclude) + "\n").encode()


def utcnow() -> datetime:
    return datetime.now(UTC)


class YankRecord(BaseModel):
    """Marker stored next to a manifest: the version stays pullable by pin but is never `latest`."""

    model_config = ConfigDict(extra="forbid")

    yanked: datetime
    reason: str | None = Field(None, max_length=1000)
