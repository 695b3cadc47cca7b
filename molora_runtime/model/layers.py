"""Building blocks of the decoder: RMSNorm, rotary embeddings, the LoRA-aware linear."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels import routed_lora, routed_lora_multi
from kernels.stacked import routed_lora_stacked
from molora_runtime.model.arch import RopeConfig
from molora_runtime.model.lora_context import LoRAContext
from molora_runtime.model.packed_linear import (
    PackedPairs,
    PackedWeight,
    linear,
    pack_chosen,
    packed_ready,
    routed_lora_packed,
)

if TYPE_CHECKING:
    from molora_runtime.model.group_buffers import GroupLoRABuffers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies, with Llama-3 frequency-dependent scaling when configured."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.kind == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv.float()


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        inv = rope_inv_freq(head_dim, rope)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [N, H, hd], k: [N, Hkv, hd], positions: [N]."""
        return self.at(positions)(q, k)

    def at(self, positions: torch.Tensor) -> Rotation:
        """The rotation of these positions, looked up once per forward for every layer."""
        return Rotation(self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))


class Rotation:
    """cos/sin rows of one forward's positions; applies RoPE to q [N, H, hd] and k [N, Hkv, hd]."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, sin

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _rotate(q, self.cos, self.sin), _rotate(k, self.cos, self.sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(dtype)


def stacked_delta(
    buffers: LoRABuffers | GroupLoRABuffers,
    x: torch.Tensor,
    out: torch.Tensor,
    layer: int,
    stacked: tuple[int, int, torch.Tensor],
) -> torch.Tensor:
    """Add the routed delta of `x` over slots `stacked = (first, count, expanded weights)` to
    `out`, for a member's or a fused group's buffers: on their oneDNN-packed copies where that
    pays (bf16 CPU serving), else through `kernels.stacked` (a group: one expand per member)."""
    first, count, expanded = stacked

    def pair() -> tuple[torch.Tensor, torch.Tensor]:
        return buffers.stacked_pair(layer, first, count)

    if packed_ready(x):
        key = (layer, first, count)
        packed = buffers.packed_pairs.get(buffers.A, buffers.stacked_Bt, key, pair)
        if packed is not None:
            return routed_lora_packed(x, packed[0], packed[1], expanded, out)
    return buffers.add_stacked_delta(x, out, layer, first, count, expanded)


class LoRABuffers:
    """The hot-set's static slot buffers of one target module, in one of two layouts.

    - kernel layout (CUDA, training): `A[S, L, r, d_in]`, `B[S, L, d_out, r]` — what the Triton
      kernels and the differentiable reference twins read, one layer as `A[:, layer]`.
    - stacked layout (CPU serving): `A[L, S, r, d_in]`, `Bt[L, S, r, d_out]` — one layer's slots
      are one contiguous `[S·r, d]` matrix each, so a mixed batch's delta is two GEMMs
      (`kernels.stacked`); `kernel_pair` still offers the kernel-shaped (strided) views.

    Either way the tensors are allocated once and written in place, so their addresses never
    change (a captured graph stays valid).
    """

    def __init__(self, A: torch.Tensor, B: torch.Tensor, stacked: bool = False) -> None:
        self.A = A
        self.B = B  # kernel layout: B; stacked layout: Bt
        self.stacked = stacked
        self.packed_pairs = PackedPairs()  # packed copies of stacked pairs (CPU bf16)
        # Views of one layer's slot range, made once: a decode step asks for the same few
        # ranges in every layer, and each view costs a dispatch or three (the buffers never move).
        self._stacked_views: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def allocate(
        cls,
        slots: int,
        layers: int,
        rank: int,
        d_in: int,
        d_out: int,
        dtype: torch.dtype,
        device: torch.device,
        stacked: bool,
    ) -> LoRABuffers:
        if stacked:
            A = torch.zeros(layers, slots, rank, d_in, dtype=dtype, device=device)
            Bt = torch.zeros(layers, slots, rank, d_out, dtype=dtype, device=device)
            return cls(A, Bt, stacked=True)
        A = torch.zeros(slots, layers, rank, d_in, dtype=dtype, device=device)
        B = torch.zeros(slots, layers, d_out, rank, dtype=dtype, device=device)
        return cls(A, B)

    @property
    def num_slots(self) -> int:
        return self.A.shape[1] if self.stacked else self.A.shape[0]

    @property
    def rank(self) -> int:
        return self.A.shape[2]

    def kernel_pair(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`A [S, r, d_in]`, `B [S, d_out, r]` of one layer (views; strided when stacked)."""
        if self.stacked:
            return self.A[layer], self.B[layer].transpose(1, 2)
        return self.A[:, layer], self.B[:, layer]

    def stacked_pair(self, layer: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`A_flat [count·r, d_in]`, `Bt_flat [count·r, d_out]` over slots first..first+count-1."""
        assert self.stacked, "only the stacked layout has contiguous per-layer slot blocks"
        key = (layer, first, count)
        views = self._stacked_views.get(key)
        if views is None:
            r = self.rank
            A = self.A[layer, first : first + count].reshape(count * r, -1)
            Bt = self.B[layer, first : first + count].reshape(count * r, -1)
            views = self._stacked_views[key] = (A, Bt)
        return views

    def add_stacked_delta(
        self, x: torch.Tensor, out: torch.Tensor, layer: int, first: int, count: int,
        expanded: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Add the routed delta of `x` over slots `[first, first + count)` to `out`."""
        a_flat, bt_flat = self.stacked_pair(layer, first, count)
        return routed_lora_stacked(x, a_flat, bt_flat, expanded, out=out)

    @property
    def stacked_Bt(self) -> torch.Tensor:
        """The whole stacked `Bt` tensor (stacked layout only)."""
        return self.B

    def clear_slot(self, slot: int) -> None:
        if self.stacked:
            self.A[:, slot].zero_()
            self.B[:, slot].zero_()
        else:
            self.A[slot].zero_()
            self.B[slot].zero_()

    def write(self, slot: int, layer: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Copy one layer's `a [r, d_in]`, `b [d_out, r]` (r <= max rank) into `slot`."""
        r = a.shape[0]
        if self.stacked:
            self.A[layer, slot, :r].copy_(a)
            self.B[layer, slot, :r].copy_(b.t())
        else:
            self.A[slot, layer, :r].copy_(a)
            self.B[slot, layer, :, :r].copy_(b)


class LoRALinear(nn.Module):
    """A base projection plus the routed LoRA delta of whatever adapters each token selects.

    In a fused group (q/k/v, gate/up) the group computes the base GEMM once over concatenated
    weights (this module's `weight` is then a view of it) and asks each member only for its
    delta, through `add_delta`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, name: str, layer: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.name = name
        self.layer = layer
        self.lora: LoRABuffers | None = None  # attached by the hot-set
        self.packed: PackedWeight | None = None  # packed copy of `weight` (CPU serving)

    def pack(self) -> None:
        self.packed = pack_chosen(self.weight)

    def forward(self, x: torch.Tensor, ctx: LoRAContext | None) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.packed)
        return self.add_delta(x, y, ctx)

    def add_delta(self, x: torch.Tensor, y: torch.Tensor, ctx: LoRAContext | None) -> torch.Tensor:
        """`y` plus this projection's routed LoRA delta for `x` (in place where possible)."""
        if ctx is None or self.lora is None:
            return y
        stacked = ctx.stacked_weights(self.lora) if self.lora.stacked else None
        if stacked is not None:
            return stacked_delta(self.lora, x, y, self.layer, stacked)
        A, B = self.lora.kernel_pair(self.layer)
        delta = routed_lora(
            x, A, B, ctx.slot_ids, ctx.weights, plan=ctx.segment_plan(), meta=ctx.kernel_meta()
        )
        return y + delta.to(y.dtype)


class FusedLinear(nn.Module):
    """Several projections of one input (q/k/v, gate/up) as one GEMM over concatenated weights.

    The members keep their own parameters as views of the fused weight, so loading, training
    and the hot-set see them unchanged; only the forward runs one base GEMM instead of several,
    and one routed-LoRA shrink + expand for the whole group (`_add_group_delta`).
    Call `fuse()` once the members' weights are loaded.
    """

    def __init__(self, members: list[LoRALinear]) -> None:
        super().__init__()
        self.members = members  # plain list: the parent module owns them
        # Non-persistent buffers: checkpoints keep the members' own tensors.
        self.register_buffer("weight", None, persistent=False)
        self.register_buffer("bias", None, persistent=False)
        self.splits = [m.weight.shape[0] for m in members]
        self.packed: PackedWeight | None = None  # packed copy of the fused weight (CPU serving)
        self.lora: GroupLoRABuffers | None = None  # stacked group layout (CPU hot-set)

    @property
    def layer(self) -> int:
        return self.members[0].layer

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.members)

    def pack(self) -> None:
        if self.weight is not None:
            self.packed = pack_chosen(self.weight)

    def fuse(self) -> None:
        with torch.no_grad():
            weight = torch.cat([m.weight.detach() for m in self.members])
            has_bias = [m.bias is not None for m in self.members]
            bias = (
                torch.cat([m.bias.detach() for m in self.members])  # type: ignore[union-attr]
                if all(has_bias)
                else None
            )
        start = 0
        for m, n in zip(self.members, self.splits, strict=True):
            m.weight = nn.Parameter(weight[start : start + n], requires_grad=False)
            if bias is not None:
                m.bias = nn.Parameter(bias[start : start + n], requires_grad=False)
            start += n
        if any(has_bias) and not all(has_bias):
            raise ValueError("a fused group needs a bias on every member or on none")
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor, ctx: LoRAContext | None) -> list[torch.Tensor]:
        if self.weight is None:
            return [m(x, ctx) for m in self.members]
        y = linear(x, self.weight, self.bias, self.packed)
        if ctx is not None and self.lora is not None:
            stacked = ctx.stacked_weights(self.lora)
            if stacked is not None:  # one shrink + one expand straight into the fused output
                stacked_delta(self.lora, x, y, self.layer, stacked)
                return list(torch.split(y, self.splits, dim=-1))
        outs = list(torch.split(y, self.splits, dim=-1))
        if ctx is None:
            return outs
        return self._add_group_delta(x, outs, ctx)

    def _add_group_delta(
        self, x: torch.Tensor, outs: list[torch.Tensor], ctx: LoRAContext
    ) -> list[torch.Tensor]:
        """Kernel layout: one multi-output routed LoRA over the targeted members."""
        hit = [i for i, m in enumerate(self.members) if m.lora is not None]
        if not hit:
            return outs
        if any(self.members[i].lora.stacked for i in hit):  # type: ignore[union-attr]
            return [m.add_delta(x, o, ctx) for m, o in zip(self.members, outs, strict=True)]
        pairs = [self.members[i].lora.kernel_pair(self.layer) for i in hit]  # type: ignore[union-attr]
        deltas = routed_lora_multi(
            x, pairs, ctx.slot_ids, ctx.weights, plan=ctx.segment_plan(), meta=ctx.kernel_meta()
        )
        for i, delta in zip(hit, deltas, strict=True):
            outs[i] = outs[i] + delta.to(outs[i].dtype)
        return outs
