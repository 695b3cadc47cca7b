"""Decode attention over a paged KV cache (block tables), with a plain PyTorch twin.

Layout (one layer): `k_cache`/`v_cache` [num_blocks, KVH, block_size, D]; sequence b's token
at position p lives in block `block_tables[b, p // block_size]`, offset `p % block_size`.
`block_tables` [B, max_blocks] int32 is padded with any valid block id past a sequence's
blocks, so its shape stays static (CUDA-graph capture); `context_lens` [B] int32 counts the
context incl. the current token, and a row with length 0 is batch padding: its output is 0.
GQA: query head h reads KV head h // (H // KVH). Softmax is computed in fp32; the result is in
q's dtype.

`paged_decode_attention_reference` is the definition (a per-sequence loop), the twin of the
Triton kernel (`kernels.triton_paged_attention`) and of the runtime's CPU path
(`molora_runtime.model.paged_decode`). Importing this module never imports triton.
"""

from __future__ import annotations

import torch

from kernels.paged_inputs import PagedDecodeInputs


def gather_paged_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` positions as a contiguous [KVH, length, D] tensor.

    For paths that want the un-paged K/V of one sequence (prefill over a cached prefix).
    """
    bs = cache.shape[2]
    blocks = block_table[: -(-length // bs)].long()
    kv = cache.index_select(0, blocks)  # [n, KVH, bs, D]
    return kv.transpose(0, 1).reshape(cache.shape[1], -1, cache.shape[3])[:, :length]


def write_paged_kv(cache: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """Store token rows `values` [T, KVH, D] at flat slots (block · block_size + offset) [T].

    Every slot must be valid: give batch-padding rows a scratch block's slot rather than -1.
    """
    bs = cache.shape[2]
    slots = slots.to(device=cache.device, dtype=torch.long)
    cache[slots // bs, :, slots % bs] = values.to(cache.dtype)


def paged_decode_attention_reference(inputs: PagedDecodeInputs) -> torch.Tensor:
    """The definition: per sequence, gather its blocks, fp32 softmax(q·kᵀ·scale)·v."""
    inputs.check()
    q, k_cache, v_cache, block_tables = (
        inputs.q,
        inputs.k_cache,
        inputs.v_cache,
        inputs.block_tables,
    )
    B, H, D = q.shape
    group = H // k_cache.shape[1]
    out = torch.zeros(B, H, D, dtype=torch.float32, device=q.device)
    for b, length in enumerate(inputs.context_lens.tolist()):
        if length <= 0:
            continue
        k = gather_paged_kv(k_cache, block_tables[b], length).float()
        v = gather_paged_kv(v_cache, block_tables[b], length).float()
        k = k.repeat_interleave(group, dim=0)  # [H, L, D]
        v = v.repeat_interleave(group, dim=0)
        scores = torch.einsum("hd,hld->hl", q[b].float(), k) * inputs.scale
        out[b] = torch.einsum("hl,hld->hd", torch.softmax(scores, dim=-1), v)
    return out.to(q.dtype)
