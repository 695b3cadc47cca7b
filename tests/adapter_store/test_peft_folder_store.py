"""The read-only PEFT-folder store (`peft:<dir or s3 prefix>`) and layered stores, over a local
directory and a real SeaweedFS bucket: content-hash versions, the push rulebook, the verified
cache, refused writes, and a writable layer over read-only ones."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from adapter_store import (
    AdapterStoreSource,
    NotFoundError,
    Registry,
    open_backend,
    open_registry,
)
from adapter_store.backends.local import LocalBackend
from adapter_store.backends.peft_folder import USED_FILES, PeftFolderBackend, content_version
from adapter_store.errors import IntegrityError, ReadOnlyStoreError
from adapter_store.validate import sha256_file
from tests.adapter_store.test_store_cli import run

FILES = ("adapter_config.json", "adapter_model.safetensors")


def put_folder(url: str, name: str, folder: Path) -> None:
    """Upload a PEFT folder as `<url>/<name>/<file>` (a plain prefix, no registry layout)."""
    backend = open_backend(url, create=True)
    for path in sorted(folder.iterdir()):
        backend.upload_file(f"{name}/{path.name}", path)


def folder_version(folder: Path) -> str:
    used = [f for f in USED_FILES if (folder / f).is_file()]
    return content_version([(f, sha256_file(folder / f)) for f in used])


@pytest.fixture
def peft_url(store_url: str, adapters_dir: Path, tmp_path: Path) -> str:
    """alpha and beta as Ray Serve LLM keeps them, plus folders the rulebook refuses."""
    put_folder(store_url, "alpha", adapters_dir / "alpha")
    put_folder(store_url, "beta", adapters_dir / "beta")
    dora = tmp_path / "dora"
    shutil.copytree(adapters_dir / "alpha", dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps(cfg | {"use_dora": True}))
    put_folder(store_url, "dora", dora)
    no_weights = tmp_path / "noweights"
    no_weights.mkdir()
    shutil.copy(adapters_dir / "alpha" / "adapter_config.json", no_weights)
    put_folder(store_url, "noweights", no_weights)
    put_folder(store_url, "Upper_Case", adapters_dir / "alpha")
    return f"peft:{store_url}"


def test_folders_are_served_by_content_hash_through_the_cache(
    peft_url: str, adapters_dir: Path, tmp_path: Path
) -> None:
    registry = open_registry(peft_url)
    served = {m.name: m for m in registry.catalog("adapter")}
    assert sorted(served) == ["alpha", "beta"]
    assert registry.catalog("composition") == []
    alpha = served["alpha"]
    assert alpha.version == folder_version(adapters_dir / "alpha")
    assert {e.path: e.sha256 for e in alpha.files} == {
        f: sha256_file(adapters_dir / "alpha" / f) for f in USED_FILES
    }
    assert (alpha.rank, alpha.base_model) == (4, "tiny-llama-test")
    problems = registry.backend.problems()
    assert "use_dora" in problems["dora"] or "DoRA" in problems["dora"]
    assert "adapter_model.safetensors" in problems["noweights"]
    assert "not an adapter name" in problems["Upper_Case"]
    # The same cache and verification path as a normal store, pinned or latest.
    source = AdapterStoreSource(registry=registry, cache_dir=tmp_path / "cache")
    for ref in ("alpha", alpha.ref):
        folder = source.adapter_path(ref)
        assert folder.is_relative_to(tmp_path / "cache")
        for f in FILES:
            assert sha256_file(folder / f) == sha256_file(adapters_dir / "alpha" / f)
    assert registry.verify(alpha) == []
    # `molora adapters copy` moves a folder into a normal store as it is, version and all.
    copied, _ = open_registry(str(tmp_path / "dst"), create=True).copy_from(
        registry, "adapter", "alpha"
    )
    assert (copied.ref, copied.files) == (alpha.ref, alpha.files)
    with pytest.raises(NotFoundError):
        source.adapter_path("dora")
    with pytest.raises(NotFoundError):
        registry.manifest("adapter", "alpha", "0123456789abcdef")


def test_an_edited_folder_is_a_new_version(
    peft_url: str, adapters_dir: Path, tmp_path: Path
) -> None:
    registry = open_registry(peft_url)
    old = registry.latest("adapter", "alpha")
    put_folder(peft_url.removeprefix("peft:"), "alpha", adapters_dir / "beta")
    new = open_registry(peft_url).latest("adapter", "alpha")
    assert new.version == folder_version(adapters_dir / "beta") != old.version
    # A reader pinned to the old version finds it gone, never the new bytes under the old name.
    with pytest.raises(NotFoundError):
        open_registry(peft_url).manifest("adapter", "alpha", old.version)
    assert registry.verify(old)  # its files are gone: verify reports them
    with pytest.raises((NotFoundError, IntegrityError)):  # gone, or caught by its checksum
        registry.fetch(old, old.file(FILES[1]), None)
    source = AdapterStoreSource(registry=open_registry(peft_url), cache_dir=tmp_path / "c")
    assert sha256_file(source.adapter_path("alpha") / FILES[1]) == sha256_file(
        adapters_dir / "beta" / FILES[1]
    )


def test_writes_are_refused_with_a_clear_error(
    peft_url: str, alpha: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    registry = open_registry(peft_url)
    before = registry.backend.inner.list_keys("")
    with pytest.raises(ReadOnlyStoreError, match="read-only"):
        registry.publish_adapter(alpha, "gamma", "v1")
    m = registry.latest("adapter", "alpha")
    for act in (registry.yank, registry.delete):
        with pytest.raises(ReadOnlyStoreError, match="PEFT"):
            act("adapter", "alpha", m.version)
    registry.unyank("adapter", "alpha", m.version)  # not yanked: nothing to write
    assert registry.backend.inner.list_keys("") == before
    code, _ = run(capsys, "adapters", "push", str(alpha), "--name", "g", "--version", "1",
                  "--store", peft_url, "--json")  # fmt: skip
    assert code == ReadOnlyStoreError.exit_code


def test_local_symlinked_files_are_refused(tmp_path: Path, adapters_dir: Path) -> None:
    root = tmp_path / "loras"
    (root / "linked").mkdir(parents=True)
    shutil.copy(adapters_dir / "alpha" / FILES[0], root / "linked")
    (root / "linked" / FILES[1]).symlink_to(adapters_dir / "alpha" / FILES[1])
    registry = open_registry(f"peft:{root}")
    assert registry.catalog("adapter") == []
    assert "symbolic link" in registry.backend.problems()["linked"]
    # Over the size limit: refused from the listing's sizes, before a byte is downloaded.
    shutil.copytree(adapters_dir / "alpha", root / "big")
    small = PeftFolderBackend(LocalBackend(root), max_bytes=1000)
    assert Registry(small).catalog("adapter") == []
    assert "over the 1000-byte limit" in small.problems()["big"]
    # Keys that try to leave the prefix name nothing.
    for key in ("adapters/../big/x/manifest.json", "adapters/big/../../etc/passwd", "../x"):
        assert not small.exists(key)


def test_a_layered_store_writes_only_its_top(
    store_url: str, alpha: Path, beta: Path, adapters_dir: Path, tmp_path: Path
) -> None:
    lower = open_registry(store_url, create=True)
    lower.publish_adapter(alpha, "alpha", "v1")
    peft_dir = tmp_path / "peft"
    put_folder(str(peft_dir), "gamma", adapters_dir / "beta")
    lower_keys = lower.backend.list_keys("")
    top = tmp_path / "top"
    layered = open_registry(f"{top}|{store_url}|peft:{peft_dir}")
    assert [m.name for m in layered.catalog("adapter")] == ["alpha", "gamma"]
    layered.publish_adapter(beta, "beta", "v1")
    layered.publish_adapter(beta, "alpha", "v2")
    assert sorted(open_registry(str(top)).names("adapter")) == ["alpha", "beta"]
    assert layered.latest("adapter", "alpha").version == "v2"
    # Yanking a version stored below marks it on top; the lower store is untouched.
    layered.yank("adapter", "alpha", "v1", "replaced")
    assert [v.yanked for v in layered.versions("adapter", "alpha")] == [True, False]
    layered.unyank("adapter", "alpha", "v1")
    with pytest.raises(ReadOnlyStoreError, match="lower layer"):
        layered.delete("adapter", "alpha", "v1", force=True)
    layered.delete("adapter", "alpha", "v2", force=True)
    assert lower.backend.list_keys("") == lower_keys
    source = AdapterStoreSource(registry=layered, cache_dir=tmp_path / "cache")
    assert (source.adapter_path("alpha") / FILES[1]).is_file()
    assert (source.adapter_path("gamma") / FILES[1]).is_file()
    with pytest.raises(ReadOnlyStoreError):
        open_registry(f"ro:{store_url}").yank("adapter", "alpha", "v1")


@pytest.mark.parametrize("spool_bytes", [64 * 2**20, 1024], ids=["in-memory", "spilled"])
def test_a_folder_is_read_once_to_check_and_hash_it(
    tmp_path: Path, adapters_dir: Path, monkeypatch: pytest.MonkeyPatch, spool_bytes: int
) -> None:
    """Deriving a folder's manifest reads each file once (the rulebook and the hash see the
    same bytes), in memory or, past the spool size, through a temp file: the same version."""
    from adapter_store.backends import peft_folder

    monkeypatch.setattr(peft_folder, "SPOOL_BYTES", spool_bytes)
    shutil.copytree(adapters_dir / "alpha", tmp_path / "peft" / "alpha")
    inner = LocalBackend(tmp_path / "peft")
    reads: list[str] = []
    real = inner.download

    def counting(key, out, progress=None, size=None):  # type: ignore[no-untyped-def]
        reads.append(key)
        real(key, out, progress, size)

    monkeypatch.setattr(inner, "download", counting)
    manifest = PeftFolderBackend(inner).current("alpha")
    assert manifest is not None
    assert manifest.version == folder_version(adapters_dir / "alpha")
    used = sorted(f"alpha/{f}" for f in USED_FILES if (adapters_dir / "alpha" / f).is_file())
    assert sorted(reads) == used


def test_a_catalog_load_lists_the_store_once(
    peft_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A catalog load (every folder, as a router's reload makes it) lists the folders' files in
    one listing of the prefix, not one per folder (over S3: a LIST per thousand objects)."""
    registry = open_registry(peft_url)
    inner = registry.backend.inner
    calls: list[str] = []
    for method in ("list_stats", "list_folder_stats"):
        real = getattr(inner, method)

        def counting(prefix, real=real, method=method):  # type: ignore[no-untyped-def]
            calls.append(method)
            return real(prefix)

        monkeypatch.setattr(inner, method, counting)
    served = [m.name for m, _ in registry.catalog_live("adapter")]
    assert served == ["alpha", "beta"]
    assert calls == ["list_folder_stats"]
    assert "not an adapter name" in registry.backend.problems()["Upper_Case"]
