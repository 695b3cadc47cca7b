"""Prefill kernels (SGMV-style): (token, top-k pair)s grouped by (j, slot), `tl.dot` tiles.

The launcher sorts the T·k pairs by key j·S + slot without a host sync (no `.item()`, no
`bincount`), so the whole path stays CUDA-graph capturable. Grids are sized for the worst case
(every pair in one segment) and empty tiles exit at once.

Shrink: one launch over all segments; h[o, pos] = A_o[s] @ x[tok[pos]] for each sorted pair.
Expand: one launch per j. Within one j a token is in at most one segment, so programs never
write the same row and the read-add-write needs no atomics; for k == 1 the result is stored
straight into the output, for k > 1 it is summed in an fp32 buffer and cast once at the end.
With half-precision inputs the shrink multiplies fp16/bf16 tiles on tensor cores and the
expand multiplies the fp32 h in tf32; fp32 inputs (and the interpreter, whose bf16 arithmetic
is wrong) use exact fp32 dots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.device_plan import PairGroups, group_pairs
from kernels.triton_common import (
    GroupLaunch,
    flat_strides,
    is_interpreted,
    load_tile,
    pad3,
    select_expand_operands,
    select_int,
    select_ptr,
    select_strides,
)


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr, sx_t, sx_d,
    tok_ptr, start_ptr, count_ptr, S,
    a0, a1, a2,
    sa0_s, sa0_r, sa0_d, sa1_s, sa1_r, sa1_d, sa2_s, sa2_r, sa2_d,
    h_ptr, P, d_in, r,
    NUM_OUT: tl.constexpr, DOT_IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    o = tl.program_id(2)
    s = (seg % S).to(tl.int64)
    count = tl.load(count_ptr + seg)
    if (s > 0) & (pid_m * BLOCK_M < count):
        a_ptr = select_ptr(o, a0, a1, a2, NUM_OUT)
        sa_s, sa_r, sa_d = select_strides(
            o, sa0_s, sa0_r, sa0_d, sa1_s, sa1_r, sa1_d, sa2_s, sa2_r, sa2_d, NUM_OUT
        )
        start = tl.load(start_ptr + seg)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < count
        tok = tl.load(tok_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < r
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for k0 in range(0, d_in, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < d_in
            xv = load_tile(x_ptr + tok[:, None] * sx_t + offs_k[None, :] * sx_d, m_mask, k_mask)
            av = load_tile(
                a_ptr + s * sa_s + offs_k[:, None] * sa_d + offs_r[None, :] * sa_r, k_mask, r_mask
            )
            if DOT_IEEE:
                acc += tl.dot(xv.to(tl.float32), av.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(xv, av)
        h_ptrs = h_ptr + (o * P + start + offs_m[:, None]) * BLOCK_R + offs_r[None, :]
        tl.store(h_ptrs, acc, mask=m_mask[:, None])


@triton.jit
def _sgmv_expand_kernel(
    h_ptr, tok_ptr, w_ptr, start_ptr, count_ptr, S, j, P, r, n_tiles,
    b0, b1, b2,
    sb0_s, sb0_n, sb0_r, sb1_s, sb1_n, sb1_r, sb2_s, sb2_n, sb2_r,
    y0, y1, y2,
    sy0_t, sy0_n, sy1_t, sy1_n, sy2_t, sy2_n,
    n0, n1, n2,
    NUM_OUT: tl.constexpr, ACCUM: tl.constexpr, DOT_IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1)
    o = tl.program_id(2) // n_tiles
    pid_n = tl.program_id(2) % n_tiles
    seg = j * S + s
    count = tl.load(count_ptr + seg)
    d_out = select_int(o, n0, n1, n2, NUM_OUT)
    if (s > 0) & (pid_m * BLOCK_M < count) & (pid_n * BLOCK_N < d_out):
        b_ptr, sb_s, sb_n, sb_r, y_ptr, sy_t, sy_n = select_expand_operands(
            o, b0, b1, b2, sb0_s, sb0_n, sb0_r, sb1_s, sb1_n, sb1_r, sb2_s, sb2_n, sb2_r,
            y0, y1, y2, sy0_t, sy0_n, sy1_t, sy1_n, sy2_t, sy2_n, NUM_OUT,
        )  # fmt: skip
        start = tl.load(start_ptr + seg)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < count
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < r
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < d_out
        tok = tl.load(tok_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
        w = tl.load(w_ptr + start + offs_m, mask=m_mask, other=0.0)
        h = load_tile(
            h_ptr + (o * P + start + offs_m[:, None]) * BLOCK_R + offs_r[None, :], m_mask, r_mask
        )
        bv = load_tile(
            b_ptr + s * sb_s + offs_r[:, None] * sb_r + offs_n[None, :] * sb_n, r_mask, n_mask
        ).to(tl.float32)
        if DOT_IEEE:
            acc = tl.dot(h, bv, input_precision="ieee")
        else:
            acc = tl.dot(h, bv, input_precision="tf32")
        acc = acc * w[:, None]
        y_ptrs = y_ptr + tok[:, None] * sy_t + offs_n[None, :] * sy_n
        mask = m_mask[:, None] & n_mask[None, :]
        if ACCUM:
            acc += tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def sgmv(launch: GroupLaunch, block_m: int | None = None, groups: PairGroups | None = None) -> None:
    """Write Σ_j w · B_o[s] A_o[s] x into the launch's outputs over the (j, slot) segments of
    the sorted pairs; `groups` are segments a `DevicePlan` already built."""
    x, As, Bs, slot_ids, weights, outs = launch
    T, K, num_out, S, r, d_in, P, block_r = launch.shape()
    if block_m is None:
        block_m = 16 if T <= 16 else (32 if T <= 128 else 64)
    block_k = 64 if block_r <= 64 else 32
    d_outs = [b.shape[1] for b in pad3(Bs)]
    block_n = max(16, min(128 if block_r <= 64 else 64, triton.next_power_of_2(max(d_outs))))
    dot_ieee = is_interpreted(x) or x.dtype == torch.float32
    if groups is None:  # callers with a per-step DevicePlan pass its cached segments
        groups = group_pairs(slot_ids, weights, S)
    tokens, sorted_w, starts, counts = groups
    h = torch.empty(num_out, P, block_r, dtype=torch.float32, device=x.device)
    a3 = pad3(As)
    sa = flat_strides(a3)
    m_tiles = triton.cdiv(T, block_m)
    _sgmv_shrink_kernel[(K * S, m_tiles, num_out)](
        x, x.stride(0), x.stride(1), tokens, starts, counts, S, *a3, *sa, h, P, d_in, r,
        NUM_OUT=num_out, DOT_IEEE=dot_ieee, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
    )  # fmt: skip
    accum = K > 1
    targets = [torch.zeros(o.shape, dtype=torch.float32, device=o.device) for o in outs]
    if not accum:
        for o in outs:
            o.zero_()
        targets = outs
    y3 = pad3(targets)
    sb, sy = flat_strides(pad3(Bs)), flat_strides(y3)
    n_tiles = triton.cdiv(max(d_outs), block_n)
    for j in range(K):
        _sgmv_expand_kernel[(S, m_tiles, n_tiles * num_out)](
            h, tokens, sorted_w, starts, counts, S, j, P, r, n_tiles, *pad3(Bs), *sb, *y3, *sy,
            *d_outs, NUM_OUT=num_out, ACCUM=accum, DOT_IEEE=dot_ieee,
            BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n,
        )  # fmt: skip
    if accum:
        for o, acc in zip(outs, targets, strict=True):
            o.copy_(acc)
