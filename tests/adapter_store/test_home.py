"""Models, the store cache and the settings file share one root, whichever variable sets it."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapter_store.config import molora_home, resolve_cache_dir
from molora_runtime.model.model_paths import prepared_model_dir


def test_xdg_cache_home_moves_models_and_adapter_cache_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MOLORA_HOME", raising=False)
    monkeypatch.delenv("MOLORA_STORE_CACHE", raising=False)
    monkeypatch.delenv("MOLORA_STORE_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert molora_home() == tmp_path / "molora"
    assert prepared_model_dir("m").parent.parent == tmp_path / "molora"
    assert resolve_cache_dir(None).parent == tmp_path / "molora"


def test_molora_home_wins_over_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOLORA_STORE_CACHE", raising=False)
    monkeypatch.delenv("MOLORA_STORE_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("MOLORA_HOME", str(tmp_path / "home"))
    assert prepared_model_dir("m") == tmp_path / "home" / "models" / "m"
    assert resolve_cache_dir(None) == tmp_path / "home" / "store-cache"
