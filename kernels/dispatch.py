"""Chooses the routed-LoRA implementation for the device and token count."""

from __future__ import annotations

import torch

from kernels.reference import routed_lora_segmented


def routed_lora(
    x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Return the routed LoRA delta [T, d_out] for x [T, d_in]; see the package docstring."""
    return routed_lora_segmented(x, A, B, slot_ids, weights)
