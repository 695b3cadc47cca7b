"""The registry: publish, copy, yank and delete versions in a backend (reading: `VersionReader`).

Key layout (identical under a directory root and an S3 prefix):

    adapters/<name>/<version>/manifest.json        written last, conditionally: the commit
    adapters/<name>/<version>/yanked.json          optional marker, excluded from `latest`
    adapters/<name>/<version>/<blob_dir>/<file>    this publish's files (a PEFT folder)
    compositions/<name>/<version>/...              same for compositions

Each publish uploads into its own `blob_dir`, so a losing concurrent publish never overwrites
the winner's files and can remove exactly what it uploaded.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, TypedDict, Unpack

from adapter_store.backends.base import Backend, Progress
from adapter_store.composition_spec import COMPOSITION_CONFIG
from adapter_store.config import open_backend
from adapter_store.errors import InvalidInputError, NotFoundError, VersionExistsError
from adapter_store.layout import MANIFEST, YANKED, AnyManifest, blob_key, version_dir
from adapter_store.manifest import AdapterManifest, CompositionManifest, YankRecord, utcnow
from adapter_store.names import Kind, check_name, check_owner, check_tenant, check_version
from adapter_store.staging import StagedPublish, file_entries, manifest_fields, new_blob_dir
from adapter_store.validate import DEFAULT_MAX_BYTES, read_composition, validate_adapter
from adapter_store.version_reader import VersionReader

# The composition.json fields a composition's manifest repeats (its adapters are pinned first).
COMPOSITION_FIELDS = {"base_model", "top_k", "temperature", "num_layers", "hidden_size"}


class PublishOptions(TypedDict, total=False):
    """What any publish may give besides its folder and ref: a description and tags (shown in
    listings), the tenant owning the name (absent: public) and a per-file upload callback."""

    description: str | None
    tags: list[str] | None
    tenant: str | None
    progress: Progress | None


def _check_ref(name: str, version: str, options: PublishOptions) -> str | None:
    """Refuse an unknown option, a malformed name, version or tenant before anything is read or
    uploaded; the tenant, when valid."""
    unknown = set(options) - PublishOptions.__optional_keys__
    if unknown:
        raise TypeError(f"unknown publish options: {', '.join(sorted(unknown))}")
    tenant = options.get("tenant")
    check_name(name)
    check_version(version)
    if tenant is not None:
        check_tenant(tenant)
    check_owner(name, tenant)
    return tenant


class Registry(VersionReader):
    """Versioned adapters and compositions over one backend: reading, publishing, removing."""

    def __init__(self, backend: Backend, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        super().__init__(backend)
        self.max_bytes = max_bytes

    # ---- publishing ----------------------------------------------------------------------------

    def _check_new(self, kind: Kind, name: str, version: str) -> None:
        if self.backend.exists(version_dir(kind, name, version) + MANIFEST):
            raise VersionExistsError(
                f"{kind} {name}@{version} already exists in store {self.url}; versions are "
                "immutable, choose a new version"
            )

    def _check_tenant(self, kind: Kind, name: str, tenant: str | None) -> None:
        """A name belongs to one tenant (or none) for good, so visibility never depends on
        which version a request pins."""
        if not self.versions(kind, name):
            return
        owner = self.owner(kind, name)
        if owner != tenant:
            have = f"tenant {owner!r}" if owner else "public"
            want = f"tenant {tenant!r}" if tenant else "public"
            raise InvalidInputError(
                f"{kind} {name!r} is {have}; a new version cannot be {want} (pick another name)"
            )

    def _upload(
        self, manifest: AnyManifest, sources: dict[str, Path], progress: Progress | None
    ) -> StagedPublish:
        staged = StagedPublish(self.backend, manifest)
        try:
            for entry in manifest.files:
                key = blob_key(manifest, entry.path)
                staged.uploaded.append(key)
                self.backend.upload_file(key, sources[entry.path], progress)
        except BaseException:
            staged.abort()
            raise
        return staged

    def _stage(
        self,
        manifest_type: type[AdapterManifest] | type[CompositionManifest],
        files: list[Path],
        name: str,
        version: str,
        options: PublishOptions,
        fields: dict[str, Any],
    ) -> StagedPublish:
        """Hash `files`, build the manifest from the ref, the `options` and the kind's `fields`,
        and upload the files."""
        entries, sources = file_entries(files)
        shared = manifest_fields(
            name, version, entries,
            options.get("description"), options.get("tags"), options.get("tenant"),
        )  # fmt: skip
        return self._upload(manifest_type(**shared, **fields), sources, options.get("progress"))

    def _check_free(self, kind: Kind, name: str, version: str, tenant: str | None) -> None:
        """The version is new and the name's owner (public or a tenant) is `tenant`."""
        self._check_new(kind, name, version)
        self._check_tenant(kind, name, tenant)

    def stage_adapter(
        self,
        folder: str | Path,
        name: str,
        version: str,
        *,
        base_model: str | None = None,
        base_config: dict[str, Any] | None = None,
        **options: Unpack[PublishOptions],
    ) -> StagedPublish:
        tenant = _check_ref(name, version, options)
        info = validate_adapter(Path(folder), base_config, self.max_bytes)
        base = base_model or info.base_model
        if not base:
            raise InvalidInputError(
                "adapter_config.json names no base_model_name_or_path: pass --base-model"
            )
        self._check_free("adapter", name, version, tenant)
        fields = info.model_dump(exclude={"files", "base_model"}) | {"base_model": base}
        return self._stage(AdapterManifest, info.files, name, version, options, fields)

    def publish_adapter(
        self, folder: str | Path, name: str, version: str, **kwargs: Any
    ) -> AnyManifest:
        return self.stage_adapter(folder, name, version, **kwargs).commit()

    def pin_adapters(
        self, refs: list[str], base_model: str, tenant: str | None = None
    ) -> list[str]:
        """Resolve each ref to `name@version`, checking it exists, fits the base model and is
        public or the composition's own tenant's (a public composition over a private expert
        would leak it)."""
        pinned = []
        for ref in refs:
            try:
                m = self.resolve("adapter", ref)
            except NotFoundError as exc:
                raise InvalidInputError(
                    f"composition adapter {ref!r} is not in the store: {exc}"
                ) from None
            if m.base_model != base_model:
                raise InvalidInputError(
                    f"composition adapter {m.ref} is for base model {m.base_model!r}, not {base_model!r}"
                )
            if m.tenant is not None and m.tenant != tenant:
                raise InvalidInputError(
                    f"composition adapter {m.ref} is private to another tenant; a composition "
                    "may only use public adapters and its own tenant's"
                )
            pinned.append(m.ref)
        return pinned

    def stage_composition(
        self, folder: str | Path, name: str, version: str, **options: Unpack[PublishOptions]
    ) -> StagedPublish:
        tenant = _check_ref(name, version, options)
        files, cfg = read_composition(Path(folder), self.max_bytes)
        self._check_free("composition", name, version, tenant)
        pinned = self.pin_adapters(cfg.adapters, cfg.base_model, tenant)
        with tempfile.TemporaryDirectory(prefix="molora-compose-") as tmp:
            stored_cfg = Path(tmp) / COMPOSITION_CONFIG
            stored_cfg.write_text(
                json.dumps(cfg.model_dump() | {"adapters": pinned}, indent=2) + "\n"
            )
            files = [stored_cfg if p.name == COMPOSITION_CONFIG else p for p in files]
            fields = cfg.model_dump(include=COMPOSITION_FIELDS) | {"adapters": pinned}
            return self._stage(CompositionManifest, files, name, version, options, fields)

    def publish_composition(
        self, folder: str | Path, name: str, version: str, **kwargs: Any
    ) -> AnyManifest:
        return self.stage_composition(folder, name, version, **kwargs).commit()

    def copy_from(
        self, src: Registry, kind: Kind, ref: str, progress: Progress | None = None
    ) -> tuple[AnyManifest, bool]:
        """Copy one version from `src` as it is (name, version, tenant, manifest fields): each
        file verified against its sha256 on the way, checked by the rulebook again, then the
        manifest written last. A composition's pinned adapters are copied first. Returns the
        manifest and whether anything was copied (False: already here with the same files)."""
        m = src.resolve(kind, ref)
        if self.backend.exists(version_dir(kind, m.name, m.version) + MANIFEST):
            here = self.manifest(kind, m.name, m.version)
            if here.files != m.files or here.tenant != m.tenant:
                raise VersionExistsError(
                    f"{kind} {m.ref} exists in {self.url} with other files or owner"
                )
            return here, False
        if isinstance(m, CompositionManifest):
            for adapter in m.adapters:
                self.copy_from(src, "adapter", adapter, progress)
        self._check_tenant(kind, m.name, m.tenant)
        with tempfile.TemporaryDirectory(prefix="molora-copy-") as tmp:
            folder = Path(tmp)
            for entry in m.files:
                src.fetch_to(m, entry, folder / entry.path, progress)
            if isinstance(m, CompositionManifest):
                read_composition(folder, self.max_bytes)
            else:
                validate_adapter(folder, None, self.max_bytes)
            copied = m.model_copy(update={"blob_dir": new_blob_dir()})
            sources = {e.path: folder / e.path for e in m.files}
            return self._upload(copied, sources, progress).commit(), True

    # ---- removing ------------------------------------------------------------------------------
    def delete(self, kind: Kind, name: str, version: str, *, force: bool = False) -> AnyManifest:
        """Remove a version: manifest first (readers stop seeing it), then its files."""
        manifest = self.manifest(kind, name, version)
        if kind == "adapter" and not force:
            users = self.users_of(manifest.ref)
            if users:
                raise InvalidInputError(
                    f"adapter {manifest.ref} is pinned by composition(s) {', '.join(users)}; "
                    "delete those first or pass --force"
                )
        vdir = version_dir(kind, name, version)
        self.backend.delete([vdir + MANIFEST])
        self.forget(kind, name, version)
        self.backend.delete([k for k in self.backend.list_keys(vdir)])
        return manifest

    def yank(self, kind: Kind, name: str, version: str, reason: str | None = None) -> AnyManifest:
        manifest = self.manifest(kind, name, version)
        record = YankRecord(yanked=utcnow(), reason=reason)
        self.backend.put_bytes(
            version_dir(kind, name, version) + YANKED, record.model_dump_json().encode()
        )
        return manifest

    def unyank(self, kind: Kind, name: str, version: str) -> AnyManifest:
        manifest = self.manifest(kind, name, version)
        self.backend.delete([version_dir(kind, name, version) + YANKED])
        return manifest


def open_registry(
    url: str,
    endpoint_url: str | None = None,
    *,
    create: bool = False,
    cache_root: Path | None = None,
    **kwargs: Any,
) -> Registry:
    """A registry over the store at `url`; `cache_root` as `open_backend` takes it."""
    backend = open_backend(url, endpoint_url, create=create, cache_root=cache_root)
    return Registry(backend, **kwargs)
