"""Tiny random Llama/Qwen3 checkpoints for fast tests and examples (no hub access needed)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Literal

import torch

from molora_runtime.model.registry import resolve_model_path

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
