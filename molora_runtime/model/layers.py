"""Building blocks of the decoder: RMSNorm, rotary embeddings, the LoRA-aware linear."""

from __future__ import annotations

import math

import torch
from torch import nn

from molora_runtime.model.arch import RopeConfig
from molora_runtime.model.lora_context import LoRAContext
from molora_runtime.model.packed_linear import PackedWeight, linear, pack_chosen
from molora_runtime.model.slot_buffers import GroupBuffers, LoRABuffers


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

    def pack(self, invariant: bool = False) -> None:
        self.packed = pack_chosen(self.weight, invariant=invariant)

    def forward(self, x: torch.Tensor, ctx: LoRAContext | None) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.packed)
        return self.add_delta(x, y, ctx)

    def add_delta(self, x: torch.Tensor, y: torch.Tensor, ctx: LoRAContext | None) -> torch.Tensor:
        """`y` plus this projection's routed LoRA delta for `x` (in place where possible)."""
        if ctx is None or self.lora is None:
            return y
        return ctx.add_lora(y, x, self.lora, self.layer)


class FusedLinear(nn.Module):
    """Several projections of one input (q/k/v, gate/up) as one GEMM over concatenated weights.

    The members keep their own parameters as views of the fused weight, so loading, training
    and the hot-set see them unchanged; only the forward runs one base GEMM instead of several,
    and one routed-LoRA call for the whole group over its `GroupBuffers`.
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
        self.lora: GroupBuffers | None = None  # the members' slot buffers (attached by the hot-set)

    @property
    def layer(self) -> int:
        return self.members[0].layer

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.members)

    def pack(self, invariant: bool = False) -> None:
        if self.weight is not None:
            self.packed = pack_chosen(self.weight, invariant=invariant)

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
            y = ctx.add_lora(y, x, self.lora, self.layer)
        return list(torch.split(y, self.splits, dim=-1))
