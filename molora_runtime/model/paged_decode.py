"""Decode attention over block tables: one query token per sequence, its context in KV blocks.

One math, three paths, all held to `kernels.paged_attention.paged_decode_attention_reference`:
CUDA runs the Triton kernel (`kernels.triton_paged_attention`); the CPU runs whichever of two
was measured faster for the cache's shape on this CPU (`cpu_attention_choice`): the C++ kernel
reading blocks in place (`kernels.cpu_paged_attention`), or a gather of each sequence's blocks
into the operand of two batched GEMMs per layer (`gathered_decode`), over the eager step's
`DecodePlan` (only the real blocks) or, for a static-shape step, a plan made from the padded
block tables (every padded block read and masked).
"""

from __future__ import annotations

import torch

from kernels import cpu_paged_attention
from kernels.paged_inputs import PagedDecodeInputs
from molora_runtime.model import cpu_attention_choice
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


def gathered_decode(inputs: PagedDecodeInputs, plan: DecodePlan) -> torch.Tensor:
    """Eager decode: gather each sequence's real blocks (one copy) and attend."""
    q, k_cache, v_cache = inputs.q, inputs.k_cache, inputs.v_cache
    nb, hkv, bs, hd = k_cache.shape
    B = q.shape[0]
    ks = k_cache.reshape(nb * hkv, bs, hd).index_select(0, plan.index)
    vs = v_cache.reshape(nb * hkv, bs, hd).index_select(0, plan.index)
    ks = ks.view(B * hkv, plan.length, hd)
    vs = vs.view(B * hkv, plan.length, hd)
    return _attend(q, ks, vs, plan.mask, inputs.scale)


def table_plan(block_tables: torch.Tensor, context_lens: torch.Tensor, kv_heads: int,
               block_size: int) -> DecodePlan:  # fmt: skip
    """The `DecodePlan` of padded block tables [B, max_blocks] with device ops only (static
    shapes: the whole table width is read, positions past `context_lens` masked; a row of
    length 0 sees its first position, so its softmax stays defined for the caller to zero)."""
    B, width = block_tables.shape
    heads = torch.arange(kv_heads, device=block_tables.device)
    index = (block_tables.long()[:, None, :] * kv_heads + heads[None, :, None]).reshape(-1)
    length = width * block_size
    visible = (
        torch.arange(length, device=block_tables.device)[None, :] < context_lens.long()[:, None]
    )
    mask = torch.zeros(B, length, dtype=torch.float32, device=block_tables.device)
    mask = mask.masked_fill(~visible, float("-inf")).view(B, 1, 1, length)
    return DecodePlan(index=index, mask=mask, length=length)


def paged_decode_tables(inputs: PagedDecodeInputs) -> torch.Tensor:
    """Decode attention over padded block tables (block_tables [B, max_blocks] int32,
    context_lens [B] int32) -> [B, H, D]."""
    if inputs.q.is_cuda:
        # triton is optional (the `kernels` extra) and only CUDA runs it
        from kernels.triton_paged_attention import paged_decode_attention_triton

        return paged_decode_attention_triton(inputs)
    inputs.check()
    q, context_lens = inputs.q, inputs.context_lens
    if q.shape[0] == 0:
        return torch.zeros_like(q)
    _, kv_heads, block_size, _ = inputs.k_cache.shape
    plan = table_plan(inputs.block_tables, context_lens, kv_heads, block_size)
    out = gathered_decode(inputs, plan)
    return out.masked_fill_((context_lens <= 0).to(q.device)[:, None, None], 0.0)


def paged_decode(inputs: PagedDecodeInputs, meta: CacheAttention) -> torch.Tensor:
    """One layer's decodes: on CPU the kernel or the gathered path, whichever was measured
    faster for this cache (the gathered one over the eager step's plan where there is one)."""
    q, k_cache = inputs.q, inputs.k_cache
    if (
        not q.is_cuda
        and cpu_attention_choice.choose(k_cache, q.shape[1], paged_decode_tables) == "kernel"
    ):
        return cpu_paged_attention.paged_decode(inputs)
    if not q.is_cuda and meta.decode_plan is not None and not meta.static:
        return gathered_decode(inputs, meta.decode_plan)
    return paged_decode_tables(inputs)
