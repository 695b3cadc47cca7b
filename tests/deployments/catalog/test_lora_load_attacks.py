"""`/v1/load_lora_adapter` against hostile folders in `server.runtime_lora.load_dir`: the same
rulebook as `push` refuses each with a 400 naming `lora_path`, and nothing is published."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from adapter_store import open_registry
from deployments.catalog.lora_admin import LoadLoraBody, LoraAdminError, load_lora
from deployments.config import StoreConfig
from tests.deployments.serve_helpers import adapter_files, store_copy


def _weights(folder: Path, fn: Callable[[str, np.ndarray], np.ndarray]) -> None:
    path = folder / "adapter_model.safetensors"
    save_file({k: fn(k, v) for k, v in load_file(str(path)).items()}, str(path))


def _config(folder: Path, **changes: object) -> None:
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(cfg | changes))


def _hardlink(folder: Path) -> None:
    planted = folder.parent / "someone-elses.safetensors"
    os.link(folder / "adapter_model.safetensors", planted)


ATTACKS: dict[str, tuple[Callable[[Path], None], str]] = {
    "huge-finite-b": (lambda f: _weights(f, lambda k, v: np.full_like(v, 3e38) if "lora_B" in k else v), "over the bound"),
    "alpha-1e38": (lambda f: _config(f, lora_alpha=1e38), "lora_alpha"),
    "redos-target": (lambda f: _config(f, target_modules=r"(.*.*)*\.q_proj_x"), "not in target_modules"),
    "backreference": (lambda f: _config(f, rank_pattern={r"(a)\1": 4}), "RE2"),
    "deep-config": (lambda f: (f / "adapter_config.json").write_text("[" * 100_000), "nests deeper|over 65536"),
    "hardlink": (_hardlink, "hard links"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(ATTACKS))
def test_hostile_folder_refused_at_runtime_load(tiny_assets, tmp_path: Path, case: str) -> None:

    store = store_copy(tiny_assets, tmp_path)
    registry = open_registry(str(store))
    load_dir = tmp_path / "loras"
    load_dir.mkdir()
    folder = Path(shutil.copytree(adapter_files(store), load_dir / "x"))
    mutate, message = ATTACKS[case]
    mutate(folder)
    base = json.loads((tiny_assets["model"] / "config.json").read_text())
    body = LoadLoraBody(lora_name="hostile", lora_path="x")
    with pytest.raises(LoraAdminError) as err:
        load_lora(StoreConfig(url=str(store)), load_dir, base, "evil", body)
    assert err.value.status == 400 and err.value.param == "lora_path", err.value.message
    assert re.search(message, err.value.message), err.value.message
    assert "hostile" not in registry.names("adapter")
