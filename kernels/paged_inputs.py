"""One layer's paged decode-attention inputs: the one argument every implementation takes.

The twin (`kernels.paged_attention`), the CPU kernel (`kernels.cpu_paged_attention`), the Triton
kernel (`kernels.triton_paged_attention`) and the runtime's dispatcher all read the same six
values, so they travel as one explicit object instead of six positional arguments per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class PagedDecodeInputs:
    """q [B, H, D]; k_cache/v_cache [num_blocks, KVH, block_size, D]; block_tables
    [B, max_blocks] (padded with any valid block id); context_lens [B] (0: a padding row, whose
    output is 0); scale multiplies q·kᵀ before the softmax."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    scale: float

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The five tensors, for checks that hold for each of them (device, dtype)."""
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens

    def check(self) -> None:
        """Shape checks shared by every implementation (cheap: no device syncs)."""
        q, k_cache, v_cache = self.q, self.k_cache, self.v_cache
        block_tables, context_lens = self.block_tables, self.context_lens
        if q.dim() != 3 or k_cache.dim() != 4 or block_tables.dim() != 2 or context_lens.dim() != 1:
            raise ValueError(
                "expected q [B, H, D], k_cache/v_cache [num_blocks, KVH, block_size, D], "
                "block_tables [B, max_blocks], context_lens [B]"
            )
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
        B, H, D = q.shape
        _, KVH, _, Dk = k_cache.shape
        if Dk != D:
            raise ValueError(f"head dim mismatch: q {D}, cache {Dk}")
        if H % KVH:
            raise ValueError(f"{H} query heads are not a multiple of {KVH} KV heads")
        if block_tables.shape[0] != B or context_lens.shape[0] != B:
            raise ValueError(
                f"batch mismatch: q {B}, block_tables {block_tables.shape[0]}, "
                f"context_lens {context_lens.shape[0]}"
            )
