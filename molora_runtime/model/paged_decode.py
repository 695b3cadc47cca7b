"""Decode attention over block tables: one query token per sequence, its context in KV blocks.

Three paths, one math: CUDA uses the Triton kernel (`kernels.paged_attention`, tested against
its reference twin there); a captured step off CUDA uses `paged_decode_torch` (static shapes:
every padded block is read and masked, unlike the kernel package's CPU path, which reads up to
the longest context and so syncs on it); the eager CPU step uses `gathered_decode` over the
step's `DecodePlan` (only each sequence's real blocks, gathered once into the operand of two
batched GEMMs per layer).
"""

from __future__ import annotations

import torch

from kernels.paged_attention import paged_decode_attention
from molora_runtime.model.attention_meta import CacheAttention, DecodePlan


def _attend(
    q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, H, hd]; ks/vs [B * Hkv, L, hd]; mask [B, 1, 1, L] additive -> [B, H, hd].

    GQA query groups share their KV head's GEMM (heads of a group are adjacent in q). A bf16
    cache on CPU is attended in fp32: CPUs without native bf16 GEMMs (AVX2) run a bf16 `bmm`
    several times slower than widening the gathered blocks and running it in fp32 (a 4-adapter
    bf16 decode step at 32 sequences spent 62% of its time in bf16 `bmm`)."""
    B, H, hd = q.shape
    hkv = ks.shape[0] // B
    g, L = H // hkv, ks.shape[1]
    if ks.device.type == "cpu" and ks.dtype == torch.bfloat16:
        ks, vs = ks.float(), vs.float()
    scores = torch.bmm(q.reshape(B * hkv, g, hd).to(ks.dtype), ks.transpose(1, 2))
    scores = scores.float().view(B, hkv, g, L).mul_(scale).add_(mask)
    probs = torch.softmax(scores, dim=-1).to(vs.dtype)
    return torch.bmm(probs.view(B * hkv, g, L), vs).view(B, H, hd).to(q.dtype)


def gathered_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
) -> torch.Tensor:
    """Eager decode: gather each sequence's real blocks (one copy) and attend."""
    nb, hkv, bs, hd = k_cache.shape
    B = q.shape[0]
    ks = k_cache.reshape(nb * hkv, bs, hd).index_select(0, plan.index)
    vs = v_cache.reshape(nb * hkv, bs, hd).index_select(0, plan.index)
    ks = ks.view(B * hkv, plan.length, hd)
    vs = vs.view(B * hkv, plan.length, hd)
    return _attend(q, ks, vs, plan.mask, scale)


def paged_decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`paged_decode_attention`'s signature in plain tensor ops with static shapes (capturable):
    q [B, H, D], caches [num_blocks, KVH, block_size, D], block_tables [B, max_blocks] int32,
    context_lens [B] int32 -> [B, H, D]."""
    nb, hkv, bs, hd = k_cache.shape
    B, width = block_tables.shape
    heads = torch.arange(hkv, device=q.device)
    index = (block_tables.long()[:, None, :] * hkv + heads[None, :, None]).reshape(-1)
    L = width * bs
    ks = k_cache.reshape(nb * hkv, bs, hd).index_select(0, index).view(B * hkv, L, hd)
    vs = v_cache.reshape(nb * hkv, bs, hd).index_select(0, index).view(B * hkv, L, hd)
    visible = torch.arange(L, device=q.device)[None, :] < context_lens.long()[:, None]
    mask = torch.zeros(B, L, dtype=torch.float32, device=q.device)
    mask = mask.masked_fill(~visible, float("-inf")).view(B, 1, 1, L)
    return _attend(q, ks, vs, mask, scale)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: CacheAttention,
    scale: float,
) -> torch.Tensor:
    """Route one layer's decodes to the kernel, the static twin or the eager gather."""
    if q.is_cuda:
        return paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale
        )
    if meta.decode_plan is not None and not meta.static:
        return gathered_decode(q, k_cache, v_cache, meta.decode_plan, scale)
    return paged_decode_torch(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
