"""Moving between stores: `copy` takes versions as they are (name, version, owner, pinned
experts), verified on the way; a pulled folder pushes again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapter_store import open_registry
from adapter_store.errors import IntegrityError, VersionExistsError
from adapter_store.layout import blob_key
from deployments.ops.cli import main
from tests.adapter_store.store_helpers import make_composition


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = main(list(argv))
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else {}


def test_copy_keeps_versions_owners_and_pins(capsys, store_url, alpha, beta, tmp_path) -> None:
    src_url = str(tmp_path / "src")
    src = open_registry(src_url, create=True)
    src.publish_adapter(alpha, "alpha", "v1")
    src.publish_adapter(beta, "beta", "v3", tenant="acme")
    src.publish_composition(make_composition(tmp_path / "c", ["alpha@v1"], top_k=1), "mix", "v1")
    src.publish_adapter(alpha, "old", "v1")
    src.yank("adapter", "old", "v1", "leaked")

    s = ["--store", src_url, "--json", "--to", store_url]
    code, out = run(capsys, "compositions", "copy", "mix", *s)
    assert code == 0 and out["results"] == [{"ref": "mix@v1", "copied": True}]
    dst = open_registry(store_url)
    assert dst.resolve("composition", "mix").adapters == ["alpha@v1"]  # its expert came along
    code, out = run(capsys, "adapters", "copy", "--all", *s)
    assert code == 0
    assert {(r["ref"], r["copied"]) for r in out["results"]} == {
        ("alpha@v1", False),
        ("beta@v3", True),
    }  # a yanked version is not copied by --all
    assert dst.owner("adapter", "beta") == "acme"
    for kind, ref in (("adapter", "alpha@v1"), ("adapter", "beta@v3"), ("composition", "mix")):
        a, b = src.resolve(kind, ref), dst.resolve(kind, ref)
        assert a.model_dump(exclude={"blob_dir", "created"}) == b.model_dump(
            exclude={"blob_dir", "created"}
        )
        assert dst.verify(b) == []
    # Copying again changes nothing; another file under the same version is refused.
    assert run(capsys, "adapters", "copy", "beta@v3", *s)[1]["results"][0]["copied"] is False
    other = open_registry(str(tmp_path / "other"), create=True)
    other.publish_adapter(alpha, "beta", "v3", tenant="acme")
    with pytest.raises(VersionExistsError):
        dst.copy_from(other, "adapter", "beta@v3")
    assert run(capsys, "adapters", "copy", *s)[0] == 3  # neither a ref nor --all


def test_copy_refuses_a_corrupted_source(alpha, tmp_path) -> None:
    src = open_registry(str(tmp_path / "src"), create=True)
    m = src.publish_adapter(alpha, "alpha", "v1")
    blob = tmp_path / "src" / blob_key(m, "adapter_model.safetensors")
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    dst = open_registry(str(tmp_path / "dst"), create=True)
    with pytest.raises(IntegrityError):
        dst.copy_from(src, "adapter", "alpha@v1")
    assert dst.names("adapter") == []


def test_a_pulled_folder_pushes_again(capsys, store_url, alpha, tmp_path) -> None:
    src = open_registry(str(tmp_path / "src"), create=True)
    src.publish_adapter(alpha, "alpha", "v1")
    code, out = run(
        capsys, "adapters", "pull", "alpha", "--store", str(tmp_path / "src"),
        "--cache-dir", str(tmp_path / "cache"), "--json",
    )  # fmt: skip
    pulled = Path(out["path"])
    assert (pulled / "manifest.json").is_file()
    code, out = run(
        capsys, "adapters", "push", str(pulled), "--name", "alpha", "--version", "v2",
        "--store", store_url, "--json",
    )  # fmt: skip
    assert code == 0, out
    assert [f["path"] for f in out["manifest"]["files"]] == sorted(
        p.name for p in alpha.iterdir() if not p.name.startswith(".")
    )
