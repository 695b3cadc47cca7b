"""Builders for test adapters: PEFT-saved tiny Llama adapters and synthetic PEFT folders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from tests.support.tiny_llama import SMALL_LLAMA

BASE_ID = "tiny-llama-test"


def make_peft_adapter(folder: Path, *, r: int, targets: list[str], seed: int) -> Path:
    """A real PEFT LoRA on a tiny random Llama, saved with `save_pretrained`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**SMALL_LLAMA))
    peft_model = get_peft_model(
        model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False)
    )
    peft_model.save_pretrained(str(folder))
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = BASE_ID
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def make_synthetic_adapter(
    folder: Path, *, layers: int = 2, d_in: int = 64, d_out: int = 64, r: int = 4, seed: int = 0
) -> Path:
    """A PEFT-format LoRA folder of a chosen size without torch (q_proj only)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i in range(layers):
        prefix = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((r, d_in), dtype=np.float32)
        tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((d_out, r), dtype=np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj"],
        "base_model_name_or_path": BASE_ID, "task_type": "CAUSAL_LM",
    }  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def make_composition(folder: Path, adapters: list[str], *, top_k: int = 2, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    layers, hidden = SMALL_LLAMA["num_hidden_layers"], SMALL_LLAMA["hidden_size"]
    save_file(
        {
            "gate.weight": rng.standard_normal((layers, len(adapters), hidden), dtype=np.float32),
            "gate.bias": np.zeros((layers, len(adapters)), dtype=np.float32),
        },
        str(folder / "gates.safetensors"),
    )
    cfg = {
        "format": "molora-composition", "format_version": 1, "base_model": BASE_ID,
        "adapters": adapters, "top_k": top_k, "temperature": 1.0, "num_layers": layers,
        "hidden_size": hidden,
    }  # fmt: skip
    (folder / "composition.json").write_text(json.dumps(cfg))
    return folder
