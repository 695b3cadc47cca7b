"""Which device and dtype an engine runs on, and its tokenizer."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from molora_runtime.config import EngineConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(config: EngineConfig) -> torch.device:
    """`cuda` when asked for, or when `auto` finds one; else the CPU."""
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), where bf16 GEMMs run
    about 3x faster than fp32 ones; elsewhere bf16 is emulated and slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


def pick_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on CUDA and on CPUs with native bf16 math, else fp32."""
    if config.dtype == "auto":
        if device.type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    return _DTYPES[config.dtype]


def load_tokenizer(folder: Path) -> Any | None:
    """The model folder's tokenizer; None for a folder without one (token ids in and out)."""
    if (
        not (folder / "tokenizer.json").is_file()
        and not (folder / "tokenizer_config.json").is_file()
    ):
        return None

    return AutoTokenizer.from_pretrained(str(folder))
