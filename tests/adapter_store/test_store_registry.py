"""Publish → resolve → pull round trips, latest/yank/delete, and compositions (both backends)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.numpy import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from adapter_store import (
    AdapterStoreSource,
    InvalidInputError,
    NotFoundError,
    Registry,
    VersionExistsError,
)
from adapter_store.manifest import AdapterManifest
from adapter_store.names import KINDS
from tests.adapter_store.store_helpers import BASE_ID, SMALL_LLAMA, make_composition


def test_peft_round_trip(
    registry: Registry, source: AdapterStoreSource, alpha: Path, base_config: dict
) -> None:
    m = registry.publish_adapter(
        alpha, "alpha", "1.0", base_config=base_config, description="d", tags=["math"]
    )
    assert isinstance(m, AdapterManifest)
    assert (m.rank, m.alpha, m.target_modules) == (4, 8, ["down_proj", "q_proj", "v_proj"])
    assert m.base_model == BASE_ID and m.base_model_fingerprint and m.num_layers == 2
    assert {f.path for f in m.files} == {
        "adapter_config.json",
        "adapter_model.safetensors",
        "README.md",
    }

    folder = source.adapter_path("alpha@1.0")
    assert source.adapter_path("alpha") == folder
    original = load_file(str(alpha / "adapter_model.safetensors"))
    pulled = load_file(str(folder / "adapter_model.safetensors"))
    assert original.keys() == pulled.keys()
    for key, value in original.items():
        assert (value == pulled[key]).all()
    assert json.loads((folder / "adapter_config.json").read_text()) == json.loads(
        (alpha / "adapter_config.json").read_text()
    )


def test_pulled_folder_loads_with_peft(
    registry: Registry, source: AdapterStoreSource, alpha: Path
) -> None:
    from peft import PeftModel

    registry.publish_adapter(alpha, "alpha", "1")
    base = LlamaForCausalLM(LlamaConfig(**SMALL_LLAMA))
    model = PeftModel.from_pretrained(base, str(source.adapter_path("alpha@1")))
    expected = load_file(str(alpha / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    got = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    assert torch.equal(got, torch.from_numpy(expected[key]))


def test_versions_are_immutable(registry: Registry, alpha: Path) -> None:
    registry.publish_adapter(alpha, "alpha", "1")
    with pytest.raises(VersionExistsError, match="already exists"):
        registry.publish_adapter(alpha, "alpha", "1")
    assert [v.version for v in registry.versions("adapter", "alpha")] == ["1"]


def test_latest_yank_and_delete(
    registry: Registry, source: AdapterStoreSource, alpha: Path, beta: Path
) -> None:
    registry.publish_adapter(alpha, "multi", "b-old")
    time.sleep(0.01)
    registry.publish_adapter(beta, "multi", "a-new")  # newer by creation, older by name
    assert registry.latest("adapter", "multi").version == "a-new"
    registry.yank("adapter", "multi", "a-new", reason="regression")
    assert registry.latest("adapter", "multi").version == "b-old"
    assert registry.resolve("adapter", "multi@a-new").version == "a-new"  # still pullable by pin
    registry.yank("adapter", "multi", "b-old")
    with pytest.raises(NotFoundError, match="all versions are yanked"):
        registry.latest("adapter", "multi")
    registry.unyank("adapter", "multi", "b-old")
    registry.delete("adapter", "multi", "a-new")
    assert [v.version for v in registry.versions("adapter", "multi")] == ["b-old"]
    assert not any("/a-new/" in k for k in registry.backend.list_keys("adapters/"))
    with pytest.raises(NotFoundError):
        source.adapter_path("multi@a-new")
    with pytest.raises(LookupError, match="does not exist"):
        source.adapter_path("nope")


def test_catalog_lists_latest(registry: Registry, alpha: Path, beta: Path) -> None:
    registry.publish_adapter(alpha, "alpha", "1")
    registry.publish_adapter(alpha, "alpha", "2")
    registry.publish_adapter(beta, "beta", "1")
    registry.publish_composition(
        make_composition(alpha.parent / "c", ["alpha", "beta"]), "mix", "1"
    )
    listed = {(m.kind, m.name): m.version for k in KINDS for m in registry.catalog(k)}
    assert listed == {
        ("adapter", "alpha"): "2",
        ("adapter", "beta"): "1",
        ("composition", "mix"): "1",
    }


def test_composition_pins_adapters(
    registry: Registry, source: AdapterStoreSource, alpha: Path, beta: Path, tmp_path: Path
) -> None:
    registry.publish_adapter(alpha, "alpha", "1")
    registry.publish_adapter(alpha, "alpha", "2")
    registry.publish_adapter(beta, "beta", "7")
    folder = make_composition(tmp_path / "comp", ["alpha", "beta@7"])
    m = registry.publish_composition(folder, "experts", "1")
    assert m.adapters == ["alpha@2", "beta@7"]
    pulled = source.composition_path("experts")
    stored = json.loads((pulled / "composition.json").read_text())
    assert stored["adapters"] == ["alpha@2", "beta@7"]
    gates = load_file(str(pulled / "gates.safetensors"))
    assert gates["gate.weight"].shape == (2, 2, 64)
    with pytest.raises(InvalidInputError, match="pinned by composition"):
        registry.delete("adapter", "alpha", "2")
    registry.delete("adapter", "alpha", "1")  # unpinned: fine


def test_composition_refuses_missing_or_mismatched(
    registry: Registry, alpha: Path, tmp_path: Path
) -> None:
    registry.publish_adapter(alpha, "alpha", "1")
    with pytest.raises(InvalidInputError, match="'ghost' is not in the store"):
        registry.publish_composition(
            make_composition(tmp_path / "c1", ["alpha", "ghost"]), "c", "1"
        )
    with pytest.raises(InvalidInputError, match="top_k=3 exceeds"):
        registry.publish_composition(
            make_composition(tmp_path / "c2", ["alpha"], top_k=3), "c", "1"
        )
    registry.publish_adapter(alpha, "other-base", "1", base_model="someone/else")
    with pytest.raises(InvalidInputError, match="is for base model"):
        registry.publish_composition(
            make_composition(tmp_path / "c3", ["alpha", "other-base"]), "c", "1"
        )
    bad = make_composition(tmp_path / "c4", ["alpha"], top_k=1)
    cfg = json.loads((bad / "composition.json").read_text())
    (bad / "composition.json").write_text(json.dumps(cfg | {"hidden_size": 32}))
    with pytest.raises(
        InvalidInputError, match=r"gate.weight has shape \(2, 1, 64\), expected \(2, 1, 32\)"
    ):
        registry.publish_composition(bad, "c", "1")
    assert registry.names("composition") == []
    assert registry.backend.list_keys("compositions/") == []


def test_a_misspelled_publish_option_is_refused_before_anything_is_written(
    registry: Registry, alpha: Path, base_config: dict
) -> None:
    with pytest.raises(TypeError, match="unknown publish options: tenat"):
        registry.publish_adapter(alpha, "alpha", "1", base_config=base_config, tenat="acme")
    assert registry.versions("adapter", "alpha") == []
