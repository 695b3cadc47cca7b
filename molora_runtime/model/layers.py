"""Building blocks of the decoder: RMSNorm, rotary embeddings, the LoRA-aware linear."""

from __future__ import annotations

import math

import torch
from torch import nn

from kernels import routed_lora
from molora_runtime.lora.context import LoRAContext
from molora_runtime.model.arch import RopeConfig


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
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(dtype)


class LoRABuffers:
    """The hot-set's static slot buffers of one target module: A[S, L, r, d_in], B[S, L, d_out, r]."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor) -> None:
        self.A = A
        self.B = B


class LoRALinear(nn.Module):
    """A base projection plus the routed LoRA delta of whatever adapters each token selects."""

    def __init__(self, in_features: int, out_features: int, bias: bool, name: str, layer: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.name = name
        self.layer = layer
        self.lora: LoRABuffers | None = None  # attached by the hot-set

    def forward(self, x: torch.Tensor, ctx: LoRAContext | None) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight, self.bias)
        if ctx is None or self.lora is None:
            return y
        A = self.lora.A[:, self.layer]
        B = self.lora.B[:, self.layer]
        delta = routed_lora(x, A, B, ctx.slot_ids, ctx.weights, plan=ctx.segment_plan())
        return y + delta.to(y.dtype)
