"""Triton paged decode attention: programs per (sequence, KV head, split), online softmax.

Each program loads the G = H / KVH query heads that share its KV head once, then walks its
split's share of the sequence's context in tiles of TILE tokens; every token row of a tile
looks up its own block id (`block_tables[b, pos // block_size]`), so a tile may span several
blocks and block sizes need not be powers of two. The loop bound comes from `context_lens` on
the device: only the real context is read, and the grid depends only on static shapes (B, KVH,
the padded table width), so the launch is CUDA-graph capturable. Scores are broadcast products
reduced over D (no `tl.dot`: G is below its 16-row minimum, and decode is memory-bound), with
the running max / sum / accumulator in fp32.

Split-K (flash-decoding): a small batch has too few (sequence, KV head) programs to fill the
GPU, so the context is cut into SPLITS ranges whose partial (max, sum, accumulator) a second
kernel merges; with one split the first kernel writes the output directly. A length-0 row
writes zeros. Loaded lazily by `kernels.paged_attention`; CPU tensors need TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.paged_inputs import PagedDecodeInputs
from kernels.triton_common import sm_count

MAX_SPLITS = 32
MIN_SPLIT_TILES = 4  # a split below ~4 tiles costs more in the merge than it parallelises
TILE_ELEMENTS = 8192  # BLOCK_G · TILE · BLOCK_D per broadcast product (register budget)


@triton.jit
def _paged_decode_kernel(
    q_ptr, sq_b, sq_h, sq_d,
    k_ptr, v_ptr, sk_n, sk_h, sk_t, sk_d, sv_n, sv_h, sv_t, sv_d,
    bt_ptr, sbt_b, sbt_n, len_ptr,
    o_ptr, so_b, so_h, so_d,
    m_ptr, l_ptr, acc_ptr,
    scale, G, D, BS, split_len, SPLITS,
    BLOCK_G: tl.constexpr, TILE: tl.constexpr, BLOCK_D: tl.constexpr, DIRECT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    length = tl.load(len_ptr + b)
    offs_g = tl.arange(0, BLOCK_G)
    offs_t = tl.arange(0, TILE)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < G
    d_mask = offs_d < D
    heads = kvh * G + offs_g
    qm = g_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + b * sq_b + heads[:, None] * sq_h + offs_d[None, :] * sq_d, mask=qm, other=0.0
    )
    q = q.to(tl.float32) * scale
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    start = split * split_len
    stop = tl.minimum(start + split_len, length)
    for t0 in range(start, stop, TILE):
        pos = t0 + offs_t
        t_mask = pos < stop
        blk = tl.load(bt_ptr + b * sbt_b + (pos // BS) * sbt_n, mask=t_mask, other=0)
        row = blk.to(tl.int64) * sk_n + (pos % BS) * sk_t
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr + kvh * sk_h + row[:, None] + offs_d[None, :] * sk_d, mask=kv_mask, other=0.0
        ).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, TILE]
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_row = blk.to(tl.int64) * sv_n + (pos % BS) * sv_t
        v = tl.load(
            v_ptr + kvh * sv_h + v_row[:, None] + offs_d[None, :] * sv_d, mask=kv_mask, other=0.0
        ).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    if DIRECT:
        denom = tl.where(l_i > 0, l_i, 1.0)
        out = acc / denom[:, None]
        tl.store(
            o_ptr + b * so_b + heads[:, None] * so_h + offs_d[None, :] * so_d,
            out.to(o_ptr.dtype.element_ty),
            mask=qm,
        )
    else:
        # partials laid out [B, H, SPLITS] (+ [BLOCK_D] for acc), fp32
        part = (b * (G * tl.num_programs(1)) + heads) * SPLITS + split
        tl.store(m_ptr + part, m_i, mask=g_mask)
        tl.store(l_ptr + part, l_i, mask=g_mask)
        tl.store(acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=qm)


@triton.jit
def _paged_merge_kernel(
    m_ptr, l_ptr, acc_ptr, o_ptr, so_b, so_h, so_d, H, D, SPLITS,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < SPLITS
    part = (b * H + h) * SPLITS + offs_s
    m = tl.load(m_ptr + part, mask=s_mask, other=float("-inf"))
    l_s = tl.load(l_ptr + part, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)  # empty splits weigh nothing
    total = tl.sum(w * l_s, axis=0)
    acc = tl.load(acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], mask=s_mask[:, None],
                  other=0.0)  # fmt: skip
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b * so_b + h * so_h + offs_d * so_d, out.to(o_ptr.dtype.element_ty),
             mask=offs_d < D)  # fmt: skip


def launch_shape(G: int, D: int) -> tuple[int, int, int]:
    """(BLOCK_G, TILE, BLOCK_D): the group and head dim padded to powers of two, and the
    widest token tile (16..128) whose broadcast product stays within TILE_ELEMENTS."""
    block_g, block_d = triton.next_power_of_2(G), triton.next_power_of_2(D)
    tile = max(16, min(128, TILE_ELEMENTS // (block_g * block_d)))  # powers of two throughout
    return block_g, tile, block_d


def choose_splits(t: torch.Tensor, programs: int, max_tokens: int, tile: int) -> int:
    """Splits per (sequence, KV head) so the grid has ~2 programs per SM, each split at least
    MIN_SPLIT_TILES tiles of the padded table width (static shapes only: graph-safe)."""
    want = triton.cdiv(2 * sm_count(t), max(1, programs))
    return max(1, min(MAX_SPLITS, want, max_tokens // (MIN_SPLIT_TILES * tile)))


def paged_decode_attention_triton(
    inputs: PagedDecodeInputs, splits: int | None = None
) -> torch.Tensor:
    """[B, H, D] in q's dtype; block_tables/context_lens are used as int32 on q's device.

    `splits` overrides the split-K choice (tests); None picks it from the static shapes.
    """
    inputs.check()
    q, k_cache, v_cache = inputs.q, inputs.k_cache, inputs.v_cache
    block_tables, context_lens = inputs.block_tables, inputs.context_lens
    B, H, D = q.shape
    _, KVH, bs, _ = k_cache.shape
    out = torch.empty_like(q)
    if B == 0:
        return out
    bt = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    lens = context_lens if context_lens.dtype == torch.int32 else context_lens.to(torch.int32)
    G = H // KVH
    block_g, tile, block_d = launch_shape(G, D)
    max_tokens = bt.shape[1] * bs
    if splits is None:
        splits = choose_splits(q, B * KVH, max_tokens, tile)
    split_len = triton.cdiv(triton.cdiv(max(max_tokens, 1), splits), tile) * tile
    direct = splits == 1
    if direct:
        m = l_s = acc = out  # unused
    else:
        m = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
        l_s = torch.empty_like(m)
        acc = torch.empty(B, H, splits, block_d, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(B, KVH, splits)](
        q, *q.stride(), k_cache, v_cache, *k_cache.stride(), *v_cache.stride(),
        bt, *bt.stride(), lens, out, *out.stride(), m, l_s, acc,
        float(inputs.scale), G, D, bs, split_len, splits,
        BLOCK_G=block_g, TILE=tile, BLOCK_D=block_d, DIRECT=direct,
    )  # fmt: skip
    if not direct:
        _paged_merge_kernel[(B, H)](
            m, l_s, acc, out, *out.stride(), H, D, splits,
            BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d,
        )  # fmt: skip
    return out
