"""`molora adapters|compositions …` through the real console entry point, both backends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapter_store import open_registry
from adapter_store.layout import blob_key
from deployments.ops.cli import main
from tests.adapter_store.store_helpers import make_composition


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code = main(list(argv))
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else {}


def test_cli_lifecycle(
    capsys: pytest.CaptureFixture[str],
    store_url: str,
    alpha: Path,
    tmp_path: Path,
    adapters_dir: Path,
) -> None:
    s = ["--store", store_url, "--json"]
    code, out = run(
        capsys,
        "adapters",
        "push",
        str(alpha),
        "--name",
        "alpha",
        "--version",
        "1",
        "--base-config",
        str(adapters_dir / "base"),
        "--tag",
        "math",
        *s,
    )
    assert code == 0 and out["manifest"]["rank"] == 4 and out["manifest"]["tags"] == ["math"]
    assert (
        run(capsys, "adapters", "push", str(alpha), "--name", "alpha", "--version", "1", *s)[0] == 5
    )
    code, out = run(capsys, "adapters", "push", str(alpha), "--name", "Bad", "--version", "1", *s)
    assert code == 3 and out["error"] == "InvalidInputError" and "invalid name" in out["message"]
    assert (
        run(capsys, "adapters", "push", str(alpha), "--name", "alpha", "--version", "2", *s)[0] == 0
    )

    code, out = run(capsys, "adapters", "list", *s)
    assert code == 0 and [(m["name"], m["version"]) for m in out["adapters"]] == [("alpha", "2")]
    code, out = run(capsys, "adapters", "list", "alpha", *s)
    assert [v["version"] for v in out["versions"]] == ["1", "2"]
    code, out = run(capsys, "adapters", "show", "alpha@1", *s)
    assert code == 0 and out["manifest"]["version"] == "1"
    assert run(capsys, "adapters", "show", "ghost", *s)[0] == 4

    code, out = run(capsys, "adapters", "pull", "alpha", "--cache-dir", str(tmp_path / "cache"), *s)
    assert code == 0 and out["ref"] == "alpha@2"
    assert (Path(out["path"]) / "adapter_model.safetensors").is_file()

    comp = make_composition(tmp_path / "comp", ["alpha"], top_k=1)
    code, out = run(
        capsys, "compositions", "push", str(comp), "--name", "solo", "--version", "1", *s
    )
    assert code == 0 and out["manifest"]["adapters"] == ["alpha@2"]
    assert run(capsys, "compositions", "verify", *s)[0] == 0

    assert run(capsys, "adapters", "rm", "alpha", *s)[0] == 3  # no version, no --all
    assert run(capsys, "adapters", "rm", "alpha@2", *s)[0] == 3  # pinned by solo@1
    code, out = run(capsys, "adapters", "rm", "alpha@2", "--yank", *s)
    assert code == 0 and out["yanked"] == ["alpha@2"]
    assert run(capsys, "adapters", "show", "alpha", *s)[1]["manifest"]["version"] == "1"

    registry = open_registry(store_url)
    m = registry.manifest("adapter", "alpha", "1")
    registry.backend.put_bytes(blob_key(m, "adapter_config.json"), b"{}")
    code, out = run(capsys, "adapters", "verify", *s)
    assert code == 6 and not out["ok"]
    assert [r["ref"] for r in out["results"] if not r["ok"]] == ["alpha@1"]
    assert run(capsys, "adapters", "rm", "alpha@1", *s)[0] == 0
    assert run(capsys, "adapters", "rm", "alpha", "--all", "--force", *s)[0] == 0
    assert run(capsys, "adapters", "list", "alpha", *s)[0] == 4


def test_cli_text_output_and_store_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, alpha: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MOLORA_STORE", raising=False)
    monkeypatch.setenv("MOLORA_HOME", str(tmp_path / "home"))
    assert main(["adapters", "list"]) == 3  # no store anywhere
    assert "no store configured" in capsys.readouterr().err
    (tmp_path / "deployments" / "default_store").mkdir(parents=True)
    assert main(["adapters", "push", str(alpha), "--name", "alpha", "--version", "1"]) == 0
    assert "published alpha@1" in capsys.readouterr().out
    assert (tmp_path / "deployments/default_store/adapters/alpha/1/manifest.json").is_file()
    monkeypatch.setenv("MOLORA_STORE", str(tmp_path / "other"))
    assert main(["adapters", "push", str(alpha), "--name", "beta", "--version", "1"]) == 0
    assert "published beta@1" in capsys.readouterr().out
    assert (tmp_path / "other/adapters/beta/1/manifest.json").is_file()
    assert main(["adapters", "list", "--store", "deployments/default_store"]) == 0
    assert capsys.readouterr().out.startswith("alpha@1")
    assert main(["adapters", "pull", "beta@1"]) == 0
    assert Path(capsys.readouterr().out.strip()).is_relative_to(tmp_path / "home" / "store-cache")
    assert main(["adapters", "list", "--store", "http://x/y"]) == 3
