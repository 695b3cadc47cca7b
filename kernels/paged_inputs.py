"""Input checks shared by every paged decode-attention implementation (the twin, CPU and Triton)."""

from __future__ import annotations

import torch


def check_paged_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    """Shape checks shared by every implementation (cheap: no device syncs)."""
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
