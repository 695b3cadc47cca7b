"""The tiny CUDA model set the GPU checks share: one base model, random adapters, saved MoE
compositions and an fp32 `LLM` over them.

Imports of the runtime happen on use and skip the check where pydantic or safetensors are
missing, so the GPU test modules stay importable with torch and triton alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.gpu.gpu_support import skip

HIDDEN = 128
LAYERS = 3


def tiny_model_set(
    tmp: Path,
    ranks: tuple[int, ...],
    seed: int,
    compositions: dict[str, tuple[list[str], int]],
) -> tuple[Path, dict[str, Path], dict[str, Path]]:
    """A tiny native model, adapters `a`, `b`, ... with `ranks`, and one saved composition per
    `name: (experts, top_k)` with gate weights drawn after `torch.manual_seed(seed)`."""
    try:
        from molora_runtime.lora.composition import CompositionConfig, save_composition
        from molora_runtime.model.tiny import make_native_tiny_model, make_random_adapter
    except ImportError as exc:  # pydantic/safetensors missing on a bare box
        skip(f"runtime dependencies missing: {exc}")
    model = make_native_tiny_model(tmp / "tiny", hidden_size=HIDDEN, num_layers=LAYERS)
    names = "abcdefgh"[: len(ranks)]
    adapters = {
        n: make_random_adapter(tmp / n, model, rank=r, seed=i)
        for i, (n, r) in enumerate(zip(names, ranks, strict=True))
    }
    torch.manual_seed(seed)
    comps = {}
    for name, (experts, top_k) in compositions.items():
        config = CompositionConfig(
            base_model="tiny", adapters=experts, top_k=top_k, num_layers=LAYERS, hidden_size=HIDDEN
        )
        comps[name] = save_composition(
            tmp / name, config, torch.randn(LAYERS, len(experts), HIDDEN)
        )
    return model, adapters, comps


def cuda_llm(
    model: Path,
    adapters: dict[str, Path],
    compositions: dict[str, Path] | None,
    graphs: bool,
    hot_set: dict[str, Any],
    max_num_seqs: int = 8,
    max_model_len: int = 128,
) -> Any:
    """An fp32 `LLM` on CUDA over `hot_set`, with or without CUDA graphs."""
    from molora_runtime.engine.llm import LLM

    return LLM(
        model=model,
        adapters=adapters,
        compositions=compositions,
        device="cuda",
        dtype="float32",
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        enable_cuda_graph=graphs,
        hot_set=hot_set,
    )
