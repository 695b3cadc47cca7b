"""Where a version's objects live, identical under a directory root and an S3 prefix."""

from __future__ import annotations

from adapter_store.errors import InvalidInputError
from adapter_store.manifest import AdapterManifest, CompositionManifest
from adapter_store.names import KINDS, Kind, check_name, check_version

AnyManifest = AdapterManifest | CompositionManifest
MANIFEST = "manifest.json"
YANKED = "yanked.json"


def kind_prefix(kind: Kind) -> str:
    if kind not in KINDS:
        raise InvalidInputError(f"unknown kind {kind!r}; expected one of {KINDS}")
    return f"{kind}s/"


def version_dir(kind: Kind, name: str, version: str) -> str:
    return f"{kind_prefix(kind)}{check_name(name)}/{check_version(version)}/"


def blob_key(manifest: AnyManifest, path: str) -> str:
    return (
        f"{version_dir(manifest.kind, manifest.name, manifest.version)}{manifest.blob_dir}/{path}"
    )
