"""Routed-LoRA ops: per-token adapter selection over static hot-set slot buffers.

The op every LoRA-targeted projection calls:

    delta[t] = Σ_j  weights[t, j] · B[s] @ (A[s] @ x[t]),   s = slot_ids[t, j]

with `A` of shape [S, r, d_in], `B` of shape [S, d_out, r] (one layer's view of the hot-set
buffers, scale already folded into B) and slot ids <= 0 meaning "no adapter". `routed_lora`
dispatches to the best implementation for the device and token count; every implementation
has a plain PyTorch reference twin in `kernels.reference` that defines correctness.
"""

from kernels.dispatch import routed_lora

__all__ = ["routed_lora"]
