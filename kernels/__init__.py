"""Routed-LoRA and paged-attention kernels with their plain PyTorch twins.

The routed-LoRA op every LoRA-targeted projection adds to its output:

    delta[t] = Σ_j  weights[t, j] · B[s] @ (A[s] @ x[t]),   s = slot_ids[t, j],  skipped if s <= 0

`kernels.reference` holds the definition and the twins of the Triton kernels, `kernels.stacked`
the CPU layout (every slot of a range as one wide adapter), `kernels.triton_ops` the CUDA
kernels (BGMV for decode, SGMV for prefill). Which one runs is decided once per engine by the
runtime's LoRA backend, not here. Importing this package never imports triton.
"""

from kernels.reference import REFERENCE_VARIANTS, routed_lora_dense

__all__ = ["REFERENCE_VARIANTS", "routed_lora_dense"]
