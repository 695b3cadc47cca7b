"""The embedded default store: intact, fits the shipped config, and its composition routes per token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from adapter_store.versions import open_registry
from deployments.config import ServeConfig
from molora_runtime.lora.slot_sizing import sized
from molora_runtime.model.arch import load_arch
from molora_runtime.model.model_paths import resolve_model_path

ROOT = Path(__file__).resolve().parents[2]
STORE = ROOT / "deployments" / "default_store"
SYSTEM = "Answer each task as 'N. answer', one per line."
MIXED = "1. Sort these numbers in ascending order: 69, 97, 2\n2. Reverse this list of words: energy, little, it"


def shipped_config() -> ServeConfig:
    data = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    return ServeConfig.from_args(data["applications"][0]["args"])


def test_every_version_verifies_and_fits_the_shipped_hot_set() -> None:
    registry = open_registry(str(STORE))
    hot_set = shipped_config().engine.hot_set
    adapters = {}
    for name in registry.names("adapter"):
        for v in registry.versions("adapter", name):
            manifest = registry.manifest("adapter", name, v.version)
            assert registry.verify(manifest) == [], manifest.ref
            assert manifest.rank <= hot_set.max_rank
            adapters[manifest.ref] = manifest
    names = {m.name for m in adapters.values()}
    assert names == {"arithmetic", "sorting", "counting", "reversal", "draw", "read"}
    composition = registry.latest("composition", "molora")
    assert registry.verify(composition) == []
    assert set(composition.adapters) <= set(adapters), "composition pins a missing adapter"
    engine = shipped_config().engine
    arch = load_arch(resolve_model_path(engine.model))
    # fp32: the most bytes a slot can take, so the fewest slots `auto` can mean here
    slots = sized(hot_set, arch, torch.float32, engine.device, engine.max_num_seqs).num_slots
    assert isinstance(slots, int) and len(composition.adapters) <= slots
    # every named route of the shipped config pins stored adapters and fits the hot set
    routes = shipped_config().expose.routes
    assert "digits" in routes
    for name, route in routes.items():
        refs = route.adapters()
        assert set(refs) <= set(adapters), f"route {name} pins a missing adapter"
        assert len(refs) <= slots


def test_learned_composition_answers_a_mixed_request() -> None:
    """The README's served example, through the engine: each line needs a different adapter."""
    from adapter_store.source import AdapterStoreSource
    from molora_runtime.engine.llm import LLM
    from molora_runtime.engine.types import SamplingParams
    from molora_runtime.model.model_paths import ModelNotFoundError, resolve_model_path

    try:
        resolve_model_path("smollm2-135m-instruct")
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    llm = LLM(
        model="smollm2-135m-instruct",
        source=AdapterStoreSource(store_url=str(STORE)),
        device="cpu",
        dtype="float32",
        max_model_len=256,
        hot_set={"num_slots": 4, "max_rank": 16},
    )
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": MIXED}]
    sp = SamplingParams(max_tokens=32, temperature=0.0)
    routes = [{"kind": "learned", "composition": "molora"}, "sorting", "reversal"]
    learned, sorting, reversal = (r.text for r in llm.generate([messages] * 3, sp, routes))
    assert learned == "1. 2, 69, 97\n2. it, little, energy"
    # neither adapter alone gets both lines: the answer needs per-token routing
    assert sorting.splitlines()[1] != "2. it, little, energy"
    assert reversal.splitlines()[0] != "1. 2, 69, 97"
