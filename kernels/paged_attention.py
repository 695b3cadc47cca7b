"""Decode attention over a paged KV cache (block tables), with a plain PyTorch twin.

Layout (one layer): `k_cache`/`v_cache` [num_blocks, KVH, block_size, D]; sequence b's token
at position p lives in block `block_tables[b, p // block_size]`, offset `p % block_size`.
`block_tables` [B, max_blocks] int32 is padded with any valid block id past a sequence's
blocks, so its shape stays static (CUDA-graph capture); `context_lens` [B] int32 counts the
context incl. the current token, and a row with length 0 is batch padding: its output is 0.
GQA: query head h reads KV head h // (H // KVH). Softmax is computed in fp32; the result is in
q's dtype.

`paged_decode_attention_reference` is the definition (a per-sequence loop). The dispatcher
`paged_decode_attention` runs the Triton kernel (`kernels.triton_paged_attention`) on CUDA,
and on CPU a batched gather + two GEMMs that reads only up to the batch's longest context.
Importing this module never imports triton.
"""

from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F

from kernels.paged_inputs import check_paged_inputs

BACKENDS = ("auto", "triton", "torch", "reference")


def gather_paged_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` positions as a contiguous [KVH, length, D] tensor.

    For paths that want the un-paged K/V of one sequence (prefill over a cached prefix).
    """
    bs = cache.shape[2]
    blocks = block_table[: -(-length // bs)].long()
    kv = cache.index_select(0, blocks)  # [n, KVH, bs, D]
    return kv.transpose(0, 1).reshape(cache.shape[1], -1, cache.shape[3])[:, :length]


def write_paged_kv(cache: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """Store token rows `values` [T, KVH, D] at flat slots (block · block_size + offset) [T].

    Every slot must be valid: give batch-padding rows a scratch block's slot rather than -1.
    """
    bs = cache.shape[2]
    slots = slots.to(device=cache.device, dtype=torch.long)
    cache[slots // bs, :, slots % bs] = values.to(cache.dtype)


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The definition: per sequence, gather its blocks, fp32 softmax(q·kᵀ·scale)·v."""
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens)
    B, H, D = q.shape
    group = H // k_cache.shape[1]
    out = torch.zeros(B, H, D, dtype=torch.float32, device=q.device)
    for b, length in enumerate(context_lens.tolist()):
        if length <= 0:
            continue
        k = gather_paged_kv(k_cache, block_tables[b], length).float()
        v = gather_paged_kv(v_cache, block_tables[b], length).float()
        k = k.repeat_interleave(group, dim=0)  # [H, L, D]
        v = v.repeat_interleave(group, dim=0)
        scores = torch.einsum("hd,hld->hl", q[b].float(), k) * scale
        out[b] = torch.einsum("hl,hld->hd", torch.softmax(scores, dim=-1), v)
    return out.to(q.dtype)


_WORKSPACE = threading.local()


def _workspace(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reused flat buffer for the gathered keys (per thread, grown as needed).

    A fresh multi-MB tensor per call costs more than the gather itself on CPU: allocations
    past malloc's mmap threshold come back as new zeroed pages every time.
    """
    key = (dtype, device)
    bufs = getattr(_WORKSPACE, "bufs", None)
    if bufs is None:
        bufs = _WORKSPACE.bufs = {}
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        buf = bufs[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def _block_rows(block_tables: torch.Tensor, kv_heads: int, width: int) -> torch.Tensor:
    """Row ids of the cache viewed as [num_blocks · KVH, block_size · D], in (b, h, n) order."""
    bt = block_tables[:, :width].long()
    heads = torch.arange(kv_heads, device=bt.device)
    return bt[:, None, :] * kv_heads + heads[None, :, None]  # [B, KVH, width]


def _empty_like_scores(k: torch.Tensor, group: int) -> torch.Tensor:
    return torch.empty(k.shape[0], group, k.shape[1], dtype=k.dtype, device=k.device)


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Batched CPU path: keys gathered into a reused [B·KVH, L, D] buffer for one bmm, fp32
    softmax, then P·V as one `embedding_bag` straight from the cache (no V gather).

    L is the batch's longest context rounded up to whole blocks (one host read of
    `context_lens`, free on CPU). GQA query groups share their KV head's GEMM, so K/V are never
    repeated. Positions past a row's length get probability 0; their V rows (padding blocks)
    are read but weigh nothing. embedding_bag runs fbgemm's weighted row sums, ~3x faster than
    a gather + bmm for these skinny products on CPU.
    """
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens)
    B, H, D = q.shape
    num_blocks, KVH, bs, _ = k_cache.shape
    group = H // KVH
    lens = context_lens.to(device=q.device, dtype=torch.long)
    any_empty = True
    if q.is_cuda:  # no host sync: the full (static) table width
        width = block_tables.shape[1]
    elif B:
        lo, hi = (int(x) for x in lens.aminmax())
        width, any_empty = min(block_tables.shape[1], -(-hi // bs)), lo <= 0
    else:
        width = 0
    if width <= 0:
        return torch.zeros_like(q)
    length = width * bs
    rows = _block_rows(block_tables.to(q.device), KVH, width)
    dt = k_cache.dtype
    kbuf = _workspace(B * KVH * length * D, dt, q.device).view(-1, bs * D)
    k = torch.index_select(k_cache.reshape(num_blocks * KVH, bs * D), 0, rows.reshape(-1), out=kbuf)
    k = k.view(B * KVH, length, D)
    qg = q.reshape(B * KVH, group, D).to(dt)
    scores = torch.baddbmm(
        _empty_like_scores(k, group), qg, k.transpose(1, 2), beta=0.0, alpha=scale
    ).float()
    valid = torch.arange(length, device=q.device)[None, :] < lens[:, None]  # [B, L]
    valid[:, 0] = True  # length-0 rows: a defined softmax, zeroed below
    scores = scores.view(B, KVH, group, length).masked_fill_(~valid[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v_cache.dtype)
    # token rows of the cache viewed as [num_blocks · KVH · block_size, D]; one bag per query head
    tokens = (rows * bs)[..., None] + torch.arange(bs, device=q.device)
    index = tokens.view(B, KVH, 1, length).expand(B, KVH, group, length).reshape(-1)
    offsets = torch.arange(0, B * H * length, length, device=q.device)
    out = F.embedding_bag(
        index, v_cache.reshape(-1, D), offsets, mode="sum", per_sample_weights=probs.reshape(-1)
    ).view(B, H, D)
    if any_empty:
        out = out.masked_fill((lens <= 0)[:, None, None], 0.0)
    return out.to(q.dtype)


def select_paged_backend(q: torch.Tensor, backend: str | None) -> str:
    """'triton' for CUDA tensors, else 'torch'; an explicit backend wins."""
    backend = backend or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"unknown paged-attention backend {backend!r}; expected one of {BACKENDS}")
    if backend != "auto":
        return backend
    return "triton" if q.is_cuda else "torch"


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Decode attention [B, H, D] over block tables; see the module docstring.

    `backend`: None/'auto' (Triton on CUDA, the batched torch path on CPU), 'triton' (CPU
    tensors only under TRITON_INTERPRET=1), 'torch' or 'reference'.
    """
    name = select_paged_backend(q, backend)
    if name == "triton":
        if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "backend 'triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton "
                "import"
            )
        from kernels.triton_paged_attention import paged_decode_attention_triton

        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale)
    if name == "reference":
        return paged_decode_attention_reference(
            q, k_cache, v_cache, block_tables, context_lens, scale
        )
    return paged_decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale)
