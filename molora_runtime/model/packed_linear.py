"""Base-weight GEMMs on CPU through oneDNN weights packed once, not on every call.

`F.linear` on CPU hands oneDNN a plain row-major weight, which it reorders into its blocked
layout on each call. Packing once at load (as PyTorch's inductor does for frozen CPU graphs)
measured, per SmolLM2-135M projection on the 2-core dev box: 1.1-1.4x faster in bf16 and
1.5-3x in fp32 at 32 tokens, ~2x at one token (`/tmp`-free script in the issue-12 note).

Only the serving forward uses the packed copy: anything that needs autograd through the GEMM,
any other device and any dtype oneDNN does not pack keeps `F.linear`. The plain weight stays
the source of truth (checkpoints, training, the embedding a tied LM head shares).
"""

from __future__ import annotations

import logging

import torch
from torch.nn import functional as F

log = logging.getLogger(__name__)

# oneDNN picks its blocked format for a typical token count; any count runs on it.
PACK_FOR_TOKENS = 32


def packing_supported(weight: torch.Tensor) -> bool:
    """Whether `weight` can be packed for oneDNN on this build and CPU."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-packed copy of `weight [out, in]`, or None where packing is not supported."""
    if not packing_supported(weight):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_TOKENS)
    except RuntimeError:  # an unusual shape or build: the plain path is always correct
        log.debug("oneDNN weight packing failed for %s", tuple(weight.shape), exc_info=True)
        return None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through `packed` when it is safe to."""
    if packed is None or x.dim() != 2 or (torch.is_grad_enabled() and x.requires_grad):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
