"""Tenant-private names: the owner is fixed per name, and compositions cannot expose a private
expert of another tenant."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapter_store import InvalidInputError, Registry
from adapter_store.manifest import parse_manifest
from deployments.ops.cli import main
from tests.adapter_store.store_helpers import make_composition


def test_tenant_is_recorded_and_fixed_per_name(registry: Registry, alpha: Path) -> None:
    m = registry.publish_adapter(alpha, "alpha", "1", tenant="acme")
    assert m.tenant == "acme"
    assert registry.resolve("adapter", "alpha").tenant == "acme"
    assert registry.owner("adapter", "alpha") == "acme"
    with pytest.raises(InvalidInputError, match="is tenant 'acme'"):
        registry.publish_adapter(alpha, "alpha", "2")
    with pytest.raises(InvalidInputError, match="is tenant 'acme'"):
        registry.publish_adapter(alpha, "alpha", "2", tenant="globex")
    registry.publish_adapter(alpha, "alpha", "2", tenant="acme")
    registry.publish_adapter(alpha, "pub", "1")
    with pytest.raises(InvalidInputError, match="is public"):
        registry.publish_adapter(alpha, "pub", "2", tenant="acme")
    with pytest.raises(InvalidInputError, match="invalid tenant"):
        registry.publish_adapter(alpha, "other", "1", tenant="Bad/Tenant")


def test_public_manifests_stay_byte_compatible(registry: Registry, alpha: Path) -> None:
    m = registry.publish_adapter(alpha, "alpha", "1")
    raw = registry.backend.read_bytes("adapters/alpha/1/manifest.json")
    assert b"tenant" not in raw
    assert parse_manifest(raw, "x") == m


def test_composition_experts_must_be_public_or_own(
    registry: Registry, alpha: Path, beta: Path, tmp_path: Path
) -> None:
    registry.publish_adapter(alpha, "alpha", "1", tenant="acme")
    registry.publish_adapter(beta, "beta", "1")
    folder = make_composition(tmp_path / "comp", ["alpha", "beta"])
    with pytest.raises(InvalidInputError, match="private to another tenant"):
        registry.publish_composition(folder, "leak", "1")
    with pytest.raises(InvalidInputError, match="private to another tenant"):
        registry.publish_composition(folder, "leak", "1", tenant="globex")
    m = registry.publish_composition(folder, "own", "1", tenant="acme")
    assert m.tenant == "acme" and m.adapters == ["alpha@1", "beta@1"]


def test_cli_push_tenant(capsys: pytest.CaptureFixture[str], store_url: str, alpha: Path) -> None:
    s = ["--store", store_url, "--json"]
    push = ["adapters", "push", str(alpha), "--name", "alpha", "--tenant", "acme"]
    assert main([*push, "--version", "1", *s]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["manifest"]["tenant"] == "acme"
    assert main(["adapters", "push", str(alpha), "--name", "alpha", "--version", "2", *s]) == 3
    out = json.loads(capsys.readouterr().out)
    assert "is tenant 'acme'" in out["message"]
