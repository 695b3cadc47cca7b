"""Tiny real assets for serving tests: a 2-layer Llama with SmolLM2's tokenizer, and a store
holding four trained-shape PEFT adapters (random weights) and one learned composition."""

from __future__ import annotations

from pathlib import Path

import torch

from molora_runtime.config import LORA_TARGET_MODULES
from molora_runtime.lora.composition import CompositionConfig, save_composition
from molora_runtime.model.tiny import make_tiny_model as make_shared_tiny_model

ADAPTERS = ("math", "code", "poem", "chat")
COMPOSITION = "mathcode"
TARGETS = list(LORA_TARGET_MODULES)


def make_tiny_model(folder: Path) -> Path:
    return make_shared_tiny_model(folder, with_tokenizer=True, tie_word_embeddings=True)


def make_adapter(model_dir: Path, folder: Path, seed: int, rank: int = 4) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM.from_pretrained(model_dir)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    peft_model = get_peft_model(base, lora)
    peft_model.save_pretrained(folder)
    return folder


def make_store(
    model_dir: Path,
    store_dir: Path,
    work: Path,
    adapters: tuple[str, ...] = ADAPTERS,
    rank: int = 4,
) -> Path:
    """Publish `adapters` (and the `mathcode` composition when math and code are among them)."""
    from adapter_store import open_registry

    registry = open_registry(str(store_dir), create=True)
    base_model = None
    for i, name in enumerate(adapters):
        manifest = registry.publish_adapter(
            make_adapter(model_dir, work / name, seed=i + 1, rank=rank), name, "v1"
        )
        base_model = manifest.base_model
    if not {"math", "code"} <= set(adapters):
        return store_dir
    comp = CompositionConfig(
        base_model=base_model, adapters=["math", "code"], top_k=1, num_layers=2, hidden_size=64
    )
    torch.manual_seed(99)
    folder = save_composition(work / COMPOSITION, comp, torch.randn(2, 2, 64))
    registry.publish_composition(folder, COMPOSITION, "v1")
    return store_dir


def make_assets(root: Path) -> dict[str, Path]:
    """The tiny model and its store under `root`, as the `tiny_assets` fixture hands them out."""
    (root / "model").mkdir()
    (root / "work").mkdir()
    model = make_tiny_model(root / "model")
    store = make_store(model, root / "store", root / "work")
    return {"model": model, "store": store, "cache": root / "cache"}
