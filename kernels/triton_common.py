"""Shared Triton helpers: per-output operand selection and launch-size heuristics.

Imported only from the Triton kernel modules, which the runtime's LoRA backend loads lazily, so that
importing `kernels` never imports triton (tests set `TRITON_INTERPRET=1` before that happens).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

MAX_OUTPUTS = 3  # fused q/k/v is the widest group; more outputs are launched in chunks
MAX_RANK = 128


@triton.jit
def select_ptr(o, p0, p1, p2, NUM_OUT: tl.constexpr):
    """Output `o`'s pointer; compile-time trivial when NUM_OUT == 1."""
    if NUM_OUT == 1:
        p = p0
    elif NUM_OUT == 2:
        if o == 0:  # noqa: SIM108 (Triton needs statement form for runtime branches)
            p = p0
        else:
            p = p1
    else:
        if o == 0:
            p = p0
        elif o == 1:
            p = p1
        else:
            p = p2
    return p


@triton.jit
def select_int(o, v0, v1, v2, NUM_OUT: tl.constexpr):
    """Output `o`'s stride or size, by `tl.where`: Triton specialises integer arguments equal
    to 1 into constants, and a runtime if/else may not yield a constant on one side and a
    tensor on the other."""
    if NUM_OUT == 1:
        v = v0
    elif NUM_OUT == 2:
        v = tl.where(o == 0, v0, v1)
    else:
        v = tl.where(o == 0, v0, tl.where(o == 1, v1, v2))
    return v


@triton.jit
def select_strides(o, s0a, s0b, s0c, s1a, s1b, s1c, s2a, s2b, s2c, NUM_OUT: tl.constexpr):
    """Output `o`'s three strides, from the per-output (a, b, c) strides laid out in order."""
    return (
        select_int(o, s0a, s1a, s2a, NUM_OUT),
        select_int(o, s0b, s1b, s2b, NUM_OUT),
        select_int(o, s0c, s1c, s2c, NUM_OUT),
    )


@triton.jit
def select_expand_operands(
    o, b0, b1, b2, sb0_s, sb0_n, sb0_r, sb1_s, sb1_n, sb1_r, sb2_s, sb2_n, sb2_r,
    y0, y1, y2, sy0_t, sy0_n, sy1_t, sy1_n, sy2_t, sy2_n, NUM_OUT: tl.constexpr,
):  # fmt: skip
    """Output `o`'s B buffer and output rows for an expand kernel: (b_ptr, its slot, row and
    rank strides, y_ptr, its token and column strides)."""
    sb_s, sb_n, sb_r = select_strides(
        o, sb0_s, sb0_n, sb0_r, sb1_s, sb1_n, sb1_r, sb2_s, sb2_n, sb2_r, NUM_OUT
    )
    return (
        select_ptr(o, b0, b1, b2, NUM_OUT), sb_s, sb_n, sb_r,
        select_ptr(o, y0, y1, y2, NUM_OUT),
        select_int(o, sy0_t, sy1_t, sy2_t, NUM_OUT), select_int(o, sy0_n, sy1_n, sy2_n, NUM_OUT),
    )  # fmt: skip


@triton.jit
def load_tile(ptrs, row_mask, col_mask):
    """A 2-D tile at `ptrs`, zero where its row or its column is out of range."""
    return tl.load(ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0.0)


class PairShape(NamedTuple):
    """The sizes both grouped-GEMV launches start from: T tokens x K (slot, weight) pairs."""

    tokens: int
    k: int
    num_out: int
    slots: int
    rank: int
    d_in: int
    pairs: int
    block_r: int


class GroupLaunch(NamedTuple):
    """One shrink + expand: up to MAX_OUTPUTS (A_o, B_o) of the same rank sharing x and the
    routing (`slot_ids`/`weights` [T, k], int32/fp32, contiguous); output o goes to `outs[o]`."""

    x: torch.Tensor
    As: list[torch.Tensor]
    Bs: list[torch.Tensor]
    slot_ids: torch.Tensor
    weights: torch.Tensor
    outs: list[torch.Tensor]

    def shape(self) -> PairShape:
        T, K = self.slot_ids.shape
        S, r, d_in = self.As[0].shape
        return PairShape(T, K, len(self.As), S, r, d_in, T * K, rank_block(r))


def flat_strides(tensors: list[torch.Tensor]) -> list[int]:
    """Every tensor's strides, one after the other (the kernels' per-output stride arguments)."""
    return [st for t in tensors for st in t.stride()]


def rank_block(r: int) -> int:
    """Rank tile: a power of two >= 16 (the `tl.dot` minimum) covering the padded rank."""
    if r > MAX_RANK:
        raise ValueError(f"rank {r} exceeds the kernel maximum {MAX_RANK}")
    return max(16, triton.next_power_of_2(r))


def is_interpreted(t: torch.Tensor) -> bool:
    """True when the kernels run under the Triton CPU interpreter (tensor not on CUDA)."""
    return t.device.type != "cuda"


def sm_count(t: torch.Tensor) -> int:
    """Streaming multiprocessors of `t`'s device (1 under the interpreter)."""
    if t.device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(t.device).multi_processor_count


def pad3(items: list) -> list:
    """Repeat the first entry so a per-output argument list always has MAX_OUTPUTS entries."""
    return items + [items[0]] * (MAX_OUTPUTS - len(items))
