"""Routed-LoRA ops: per-token adapter selection over static hot-set slot buffers.

The op every LoRA-targeted projection calls:

    delta[t] = Σ_j  weights[t, j] · B[s] @ (A[s] @ x[t]),   s = slot_ids[t, j]

with `A` of shape [S, r, d_in], `B` of shape [S, d_out, r] (one layer's view of the hot-set
buffers, scale already folded into B; arbitrary strides, so `A_buf[:, layer]` needs no copy)
and slot ids <= 0 meaning "no adapter". The result is in `x.dtype`, accumulated in fp32.
`routed_lora` dispatches to the best implementation for the device, token count and autograd
need (it stays differentiable w.r.t. x and weights on the reference path); `routed_lora_multi`
serves several projections sharing x and the routing (q/k/v, gate/up) with fused launches on
CUDA. Every Triton kernel has a plain PyTorch reference twin in `kernels.reference`.
Importing this package never imports triton.
"""

from kernels.dispatch import routed_lora, routed_lora_multi, select_backend
from kernels.reference import REFERENCE_VARIANTS

__all__ = ["REFERENCE_VARIANTS", "routed_lora", "routed_lora_multi", "select_backend"]
