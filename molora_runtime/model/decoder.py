"""A compact decoder for the Llama and Qwen3 families with routed-LoRA projections.

All tokens of a step are flattened to [N, d]; every projection (and so every LoRA delta) runs once
over all of them, whatever route each token takes. Only attention looks at sequence structure,
through `CacheAttention` (serving, KV cache) or `DenseAttention` (training, no cache).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kernels.paged_inputs import PagedDecodeInputs
from molora_runtime.model.arch import ModelArch
from molora_runtime.model.attention_meta import CacheAttention, DenseAttention, KVCache
from molora_runtime.model.layers import FusedLinear, LoRALinear, RMSNorm, RotaryEmbedding, Rotation
from molora_runtime.model.lora_context import LoRAContext
from molora_runtime.model.packed_linear import (
    HEAD_ROWS,
    PackedWeight,
    linear,
    pack_chosen,
    packed_summary,
)
from molora_runtime.model.paged_decode import paged_decode

AttentionMeta = CacheAttention | DenseAttention


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer: int) -> None:
        super().__init__()
        d, hd = arch.hidden_size, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, hd
        self.layer = layer
        bias = arch.attention_bias
        self.q_proj = LoRALinear(d, self.num_heads * hd, bias, "q_proj", layer)
        self.k_proj = LoRALinear(d, self.num_kv_heads * hd, bias, "k_proj", layer)
        self.v_proj = LoRALinear(d, self.num_kv_heads * hd, bias, "v_proj", layer)
        self.o_proj = LoRALinear(self.num_heads * hd, d, bias, "o_proj", layer)
        self.qkv = FusedLinear([self.q_proj, self.k_proj, self.v_proj])
        self.q_norm = RMSNorm(hd, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(hd, arch.rms_norm_eps) if arch.qk_norm else None
        self.scale = hd**-0.5

    def forward(
        self,
        x: torch.Tensor,
        meta: AttentionMeta,
        rot: Rotation,
        kv: KVCache | None,
        ctx: LoRAContext | None,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x, ctx)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rot(q, k)
        if isinstance(meta, DenseAttention):
            out = self._dense(q, k, v, meta)
        else:
            assert kv is not None, "the serving path needs a KV cache"
            out = self._cached(q, k, v, meta, kv)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim), ctx)

    def _dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: DenseAttention):
        B, T = meta.batch, meta.seq_len
        q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(B * T, self.num_heads, self.head_dim)

    def _cached(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: CacheAttention,
        kv: KVCache,
    ) -> torch.Tensor:
        k_cache, v_cache = kv.k[self.layer], kv.v[self.layer]  # [blocks, Hkv, block_size, hd]
        k_cache[meta.slot_blocks, :, meta.slot_offsets] = k.to(k_cache.dtype)
        v_cache[meta.slot_blocks, :, meta.slot_offsets] = v.to(v_cache.dtype)
        D = meta.num_decode
        tables, lens = meta.block_tables, meta.context_lens
        if not meta.prefill_segments:
            return paged_decode(
                PagedDecodeInputs(q, k_cache, v_cache, tables, lens, self.scale), meta
            )
        out = torch.empty_like(q)
        if D:
            decodes = PagedDecodeInputs(q[:D], k_cache, v_cache, tables, lens, self.scale)
            out[:D] = paged_decode(decodes, meta)
        hkv, hd = self.num_kv_heads, self.head_dim
        for seg in meta.prefill_segments:
            sl = slice(seg.start, seg.start + seg.length)
            ctx_len = seg.start_pos + seg.length
            qs = q[sl].transpose(0, 1).unsqueeze(0)  # [1, H, len, hd]
            nb = seg.blocks.shape[0]
            ks = k_cache[seg.blocks].transpose(0, 1).reshape(hkv, nb * kv.block_size, hd)
            vs = v_cache[seg.blocks].transpose(0, 1).reshape(hkv, nb * kv.block_size, hd)
            ks = ks[:, :ctx_len].unsqueeze(0).to(q.dtype)
            vs = vs[:, :ctx_len].unsqueeze(0).to(q.dtype)
            if seg.start_pos == 0:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            else:
                qpos = torch.arange(seg.start_pos, ctx_len, device=q.device)
                kpos = torch.arange(ctx_len, device=q.device)
                mask = kpos[None, :] <= qpos[:, None]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
            out[sl] = o.squeeze(0).transpose(0, 1)
        return out


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, layer: int) -> None:
        super().__init__()
        d, f = arch.hidden_size, arch.intermediate_size
        self.gate_proj = LoRALinear(d, f, False, "gate_proj", layer)
        self.up_proj = LoRALinear(d, f, False, "up_proj", layer)
        self.down_proj = LoRALinear(f, d, False, "down_proj", layer)
        self.gate_up = FusedLinear([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor, ctx: LoRAContext | None) -> torch.Tensor:
        gate, up = self.gate_up(x, ctx)
        return self.down_proj(F.silu(gate).mul_(up), ctx)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch, layer)

    def forward(self, h, meta, rot, kv, ctx):
        normed = self.input_layernorm(h)
        if ctx is not None:
            ctx.begin_layer(self.layer, normed)  # learned gates read the layer's normed input
        h = h + self.self_attn(normed, meta, rot, kv, ctx)
        return h + self.mlp(self.post_attention_layernorm(h), ctx)


class CausalLM(nn.Module):
    """Decoder + LM head; `forward` serves one step over the KV cache."""

    def __init__(self, arch: ModelArch, max_positions: int | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = (
            None
            if arch.tie_word_embeddings
            else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        )
        self.rope = RotaryEmbedding(
            arch.head_dim, max_positions or arch.max_position_embeddings, arch.rope
        )
        self.packed_head: PackedWeight | None = None

    def pack_cpu_weights(self, invariant: bool = False) -> str:
        """Pack every base GEMM's weight once (CPU serving; see `packed_linear`) and say what
        they run on (`invariant`: row-invariant kinds only, in bf16 too). Call after the
        weights are loaded and fused; they must not change afterwards."""
        fused = self.fused_groups()
        in_group = {id(member) for f in fused for member in f.members}
        for f in fused:
            f.pack(invariant)  # its members never run their own GEMM
        plain = [m for m in self.lora_linears() if id(m) not in in_group]
        for m in plain:
            m.pack(invariant)
        self.packed_head = pack_chosen(self._head_weight(), HEAD_ROWS, invariant)
        return packed_summary([*(m.packed for m in (*fused, *plain)), self.packed_head])

    def _head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def fused_groups(self) -> list[FusedLinear]:
        return [m for m in self.modules() if isinstance(m, FusedLinear)]

    def lora_linears(self) -> list[LoRALinear]:
        return [m for m in self.modules() if isinstance(m, LoRALinear)]

    def fuse_projections(self) -> None:
        """Run q/k/v and gate/up as one GEMM each (call once the weights are loaded)."""
        for m in self.modules():
            if isinstance(m, FusedLinear):
                m.fuse()

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMeta,
        kv: KVCache | None,
        ctx: LoRAContext | None,
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        rot = self.rope.at(meta.positions)
        for layer in self.layers:
            h = layer(h, meta, rot, kv, ctx)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self._head_weight(), None, self.packed_head).float()

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: CacheAttention,
        kv: KVCache,
        ctx: LoRAContext | None,
        logits_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Serve one step: input_ids [N] flattened; returns logits of `logits_index` tokens."""
        hidden = self.hidden_states(input_ids, meta, kv, ctx)
        if logits_index is not None:
            hidden = hidden.index_select(0, logits_index)
        return self.logits(hidden)
