"""PEFT Arrow baseline: training-free per-token routing over the same adapters (for comparison).

Arrow (Ostapenko et al. 2024) builds each adapter's routing prototype from the top singular
vector of its LoRA update, then per token and layer mixes the top-k adapters whose prototypes
align best with the hidden state. It needs no router training, which is what MoLoRA's learned
gates must beat on mixed prompts.
"""

from __future__ import annotations

import torch

from molora_runtime.training.adapter import load_base


def load_arrow_model(
    model: str, adapter_folders: list[str], top_k: int = 1, temperature: float = 1.0
):
    """A transformers model with PEFT's Arrow router over `adapter_folders`, plus its tokenizer."""
    from peft import ArrowConfig, create_arrow_model  # the optional `train` extra

    base, tokenizer = load_base(model, torch.device("cpu"))
    arrow = create_arrow_model(
        base_model=base,
        task_specific_adapter_paths=list(adapter_folders),
        arrow_config=ArrowConfig(top_k=top_k, router_temperature=temperature, rng_seed=0),
    )
    _skip_unadapted_layers(arrow)
    arrow.eval()
    return arrow, tokenizer


def _skip_unadapted_layers(model) -> int:
    """Switch off Arrow where no task adapter exists (adapters trained on a subset of layers).

    `create_arrow_model` adds its router to every targeted projection; where the task adapters
    have no weights (their `layers_to_transform` leaves the layer out) it would route over an
    empty set and fail, while the correct output there is simply the base projection.
    """
    from peft.tuners.lora import LoraLayer  # the optional `train` extra

    skipped = 0
    for module in model.modules():
        if (
            isinstance(module, LoraLayer)
            and "arrow_router" in module.lora_A
            and not any(name.startswith("task_") for name in module.lora_A)
        ):
            module._disable_adapters = True
            skipped += 1
    return skipped
