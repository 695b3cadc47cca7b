"""Decode kernels (BGMV-style): one program per (token, top-k pair) gathers its adapter.

Shrink: h[o, p, split] = A_o[s_p] @ x[t_p] over one chunk of d_in (split-K, so that a small
decode batch still fills the GPU; the partial sums are added by the expand, without atomics).
Expand: y_o[t] = Σ_j w[t, j] · B_o[s] @ h[o, (t, j)]: the top-k weighted sum is fused, so each
output row is written once. Both kernels serve up to three outputs sharing one input (fused
q/k/v or gate/up) in a single launch. All arithmetic is fp32 (loads are upcast), which is free
for these memory-bound kernels and keeps the interpreter's bf16 handling out of the way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import (
    GroupLaunch,
    flat_strides,
    load_tile,
    pad3,
    select_expand_operands,
    select_int,
    select_ptr,
    select_strides,
    sm_count,
)


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr, sx_t, sx_d,
    slot_ptr, K,
    a0, a1, a2,
    sa0_s, sa0_r, sa0_d, sa1_s, sa1_r, sa1_d, sa2_s, sa2_r, sa2_d,
    h_ptr, P, d_in, r, chunk,
    NUM_OUT: tl.constexpr, SPLIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    split = tl.program_id(1)
    o = tl.program_id(2)
    s = tl.load(slot_ptr + pair).to(tl.int64)
    if s > 0:
        a_ptr = select_ptr(o, a0, a1, a2, NUM_OUT)
        sa_s, sa_r, sa_d = select_strides(
            o, sa0_s, sa0_r, sa0_d, sa1_s, sa1_r, sa1_d, sa2_s, sa2_r, sa2_d, NUM_OUT
        )
        t = (pair // K).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < r
        a_row = a_ptr + s * sa_s + offs_r[:, None] * sa_r
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        start = split * chunk
        for k0 in range(start, start + chunk, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < d_in
            xv = tl.load(x_ptr + t * sx_t + offs_k * sx_d, mask=k_mask, other=0.0)
            av = load_tile(a_row + offs_k[None, :] * sa_d, r_mask, k_mask)
            acc += tl.sum(av.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
        h_off = ((o * P + pair) * SPLIT + split) * BLOCK_R
        tl.store(h_ptr + h_off + offs_r, acc)


@triton.jit
def _bgmv_expand_kernel(
    h_ptr, slot_ptr, w_ptr, K, P, r,
    b0, b1, b2,
    sb0_s, sb0_n, sb0_r, sb1_s, sb1_n, sb1_r, sb2_s, sb2_n, sb2_r,
    y0, y1, y2,
    sy0_t, sy0_n, sy1_t, sy1_n, sy2_t, sy2_n,
    n0, n1, n2,
    NUM_OUT: tl.constexpr, SPLIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    o = tl.program_id(2)
    d_out = select_int(o, n0, n1, n2, NUM_OUT)
    if pid_n * BLOCK_N < d_out:
        b_ptr, sb_s, sb_n, sb_r, y_ptr, sy_t, sy_n = select_expand_operands(
            o, b0, b1, b2, sb0_s, sb0_n, sb0_r, sb1_s, sb1_n, sb1_r, sb2_s, sb2_n, sb2_r,
            y0, y1, y2, sy0_t, sy0_n, sy1_t, sy1_n, sy2_t, sy2_n, NUM_OUT,
        )  # fmt: skip
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < d_out
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < r
        offs_split = tl.arange(0, SPLIT)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in range(K):
            pair = t * K + j
            s = tl.load(slot_ptr + pair).to(tl.int64)
            if s > 0:
                w = tl.load(w_ptr + pair).to(tl.float32)
                h_base = h_ptr + (o * P + pair) * SPLIT * BLOCK_R
                h = tl.sum(
                    tl.load(h_base + offs_split[:, None] * BLOCK_R + offs_r[None, :]), axis=0
                )
                bv = load_tile(
                    b_ptr + s * sb_s + offs_n[:, None] * sb_n + offs_r[None, :] * sb_r,
                    n_mask,
                    r_mask,
                )
                acc += w * tl.sum(bv.to(tl.float32) * h[None, :], axis=1)
        tl.store(y_ptr + t * sy_t + offs_n * sy_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


def _choose_split(x: torch.Tensor, programs: int, d_in: int, block_k: int) -> int:
    """Split d_in until the shrink has ~4 programs per SM (powers of two, at most 16)."""
    target = 4 * sm_count(x)
    max_split = max(1, min(16, triton.cdiv(d_in, block_k)))
    split = 1
    while split * 2 <= max_split and programs * split < target:
        split *= 2
    return split


def bgmv(launch: GroupLaunch, split: int | None = None) -> None:
    """Write Σ_j w · B_o[s] A_o[s] x into the launch's outputs, one program per (token, top-k
    pair); `split` overrides the split-K choice (tests)."""
    x, As, Bs, slot_ids, weights, outs = launch
    T, K, num_out, _, r, d_in, P, block_r = launch.shape()
    block_k = max(16, min(triton.next_power_of_2(d_in), 8192 // block_r))
    if split is None:
        split = _choose_split(x, P * num_out, d_in, block_k)
    chunk = triton.cdiv(triton.cdiv(d_in, split), block_k) * block_k
    h = torch.empty(num_out, P, split, block_r, dtype=torch.float32, device=x.device)
    a3, b3, y3 = pad3(As), pad3(Bs), pad3(outs)
    sa = flat_strides(a3)
    _bgmv_shrink_kernel[(P, split, num_out)](
        x, x.stride(0), x.stride(1), slot_ids, K, *a3, *sa, h, P, d_in, r, chunk,
        NUM_OUT=num_out, SPLIT=split, BLOCK_R=block_r, BLOCK_K=block_k,
    )  # fmt: skip
    d_outs = [b.shape[1] for b in b3]
    block_n = max(16, min(triton.next_power_of_2(max(d_outs)), 8192 // block_r))
    sb, sy = flat_strides(b3), flat_strides(y3)
    grid = (T, triton.cdiv(max(d_outs), block_n), num_out)
    _bgmv_expand_kernel[grid](
        h, slot_ids, weights, K, P, r, *b3, *sb, *y3, *sy, *d_outs,
        NUM_OUT=num_out, SPLIT=split, BLOCK_R=block_r, BLOCK_N=block_n,
    )  # fmt: skip
