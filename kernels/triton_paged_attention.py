"""Triton paged decode attention: one program per (sequence, KV head), online softmax.

The program loads the G = H / KVH query heads that share its KV head once, then walks the
sequence's blocks — `cdiv(context_len, block_size)` of them, read from `context_lens` on the
device, so it touches only the real context and the grid stays (B, KVH) whatever the lengths
(static shapes: CUDA-graph capturable). Per block it forms the [G, block] scores by broadcast
products (no `tl.dot`: G and block sizes 4/8 are below its 16-row minimum, and decode is
memory-bound) and updates the running max / sum / accumulator in fp32. A length-0 row writes
zeros. Loaded lazily by `kernels.paged_attention`; CPU tensors need TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.paged_attention import check_paged_inputs


@triton.jit
def _paged_decode_kernel(
    q_ptr, sq_b, sq_h, sq_d,
    k_ptr, v_ptr, sk_n, sk_h, sk_t, sk_d, sv_n, sv_h, sv_t, sv_d,
    bt_ptr, sbt_b, sbt_n, len_ptr,
    o_ptr, so_b, so_h, so_d,
    scale, G, D, BS,
    BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    length = tl.load(len_ptr + b)
    offs_g = tl.arange(0, BLOCK_G)
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < G
    d_mask = offs_d < D
    t_in = offs_t < BS
    heads = kvh * G + offs_g
    qm = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + offs_d[None, :] * sq_d, mask=qm)
    q = q.to(tl.float32) * scale
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    num_blocks = tl.cdiv(length, BS)
    for i in range(0, num_blocks):
        blk = tl.load(bt_ptr + b * sbt_b + i * sbt_n).to(tl.int64)
        t_mask = t_in & (i * BS + offs_t < length)
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr + blk * sk_n + kvh * sk_h + offs_t[:, None] * sk_t + offs_d[None, :] * sk_d,
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, T]
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + blk * sv_n + kvh * sv_h + offs_t[:, None] * sv_t + offs_d[None, :] * sv_d,
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    denom = tl.where(l_i > 0, l_i, 1.0)
    out = acc / denom[:, None]
    tl.store(
        o_ptr + b * so_b + heads[:, None] * so_h + offs_d[None, :] * so_d,
        out.to(o_ptr.dtype.element_ty),
        mask=qm,
    )


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """[B, H, D] in q's dtype; block_tables/context_lens are used as int32 on q's device."""
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens)
    B, H, D = q.shape
    _, KVH, bs, _ = k_cache.shape
    out = torch.empty_like(q)
    if B == 0:
        return out
    bt = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    lens = context_lens if context_lens.dtype == torch.int32 else context_lens.to(torch.int32)
    G = H // KVH
    _paged_decode_kernel[(B, KVH)](
        q, *q.stride(), k_cache, v_cache, *k_cache.stride(), *v_cache.stride(),
        bt, *bt.stride(), lens, out, *out.stride(), float(scale), G, D, bs,
        BLOCK_G=triton.next_power_of_2(G), BLOCK_T=triton.next_power_of_2(bs),
        BLOCK_D=triton.next_power_of_2(D),
    )  # fmt: skip
    return out
