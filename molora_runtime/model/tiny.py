"""Tiny random Llama/Qwen3 checkpoints for fast tests and examples (no hub access needed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

from molora_runtime.model.arch import arch_from_config, load_arch
from molora_runtime.model.decoder import CausalLM
from molora_runtime.model.model_paths import resolve_model_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_tiny_model(
    folder: str | Path,
    family: Literal["llama", "qwen3"] = "llama",
    seed: int = 0,
    vocab_size: int = 256,
    with_tokenizer: bool = False,
    hidden_size: int = 64,
    num_layers: int = 2,
    tie_word_embeddings: bool = False,
) -> Path:
    """Write a random HF checkpoint; `with_tokenizer` borrows the embedded model's tokenizer
    (and sets the vocabulary to its size), so text prompts and chat templates work."""
    # imported here: the bare GPU box runs make_native_tiny_model without transformers
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok_src = resolve_model_path("smollm2-135m-instruct") if with_tokenizer else None
    if tok_src is not None:
        vocab_size = 49152
    common = dict(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1 if tok_src else None,
        eos_token_id=2 if tok_src else None,
    )
    config = (
        Qwen3Config(head_dim=hidden_size // 4, **common)
        if family == "qwen3"
        else LlamaConfig(**common)
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    if tok_src is not None:
        for name in TOKENIZER_FILES:
            if (tok_src / name).is_file():
                shutil.copy(tok_src / name, folder / name)
    return folder


def make_native_tiny_model(
    folder: str | Path,
    family: Literal["llama", "qwen3"] = "llama",
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
) -> Path:
    """Like `make_tiny_model` but without transformers (for the bare GPU check machine)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": family,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    torch.manual_seed(seed)
    model = CausalLM(arch_from_config(config))
    state = {}
    for name, param in model.named_parameters():
        key = name if name == "lm_head.weight" else "model." + name
        init = torch.randn_like(param) * 0.05 if param.dim() > 1 else torch.ones_like(param)
        state[key] = init.contiguous()
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def make_random_adapter(
    folder: str | Path,
    model_folder: str | Path,
    rank: int = 8,
    alpha: float | None = None,
    targets: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ),
    seed: int = 0,
    scale: float = 0.05,
) -> Path:
    """Write a random PEFT-format LoRA folder for `model_folder` (no peft needed)."""
    arch = load_arch(model_folder)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for module in targets:
            d_in, d_out = arch.linear_shape(module)
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * scale
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha if alpha is not None else 2 * rank,
        "target_modules": list(targets),
        "base_model_name_or_path": str(arch.name_or_path or "tiny"),
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder
