"""Plain-PyTorch reference implementations of the routed-LoRA op (the correctness twins)."""

from __future__ import annotations

import torch


def routed_lora_dense(
    x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Obvious per-(token, j) loop in fp32: slow, but the definition every variant is held to."""
    T, k = slot_ids.shape
    out = torch.zeros(T, B.shape[1], dtype=torch.float32, device=x.device)
    xf = x.float()
    for t in range(T):
        for j in range(k):
            s = int(slot_ids[t, j])
            if s <= 0:
                continue
            out[t] += float(weights[t, j]) * (B[s].float() @ (A[s].float() @ xf[t]))
    return out.to(x.dtype)


def routed_lora_segmented(
    x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Group (token, j) pairs by slot and run two small GEMMs per used slot (SGMV-style)."""
    T, k = slot_ids.shape
    out = torch.zeros(T, B.shape[1], dtype=torch.float32, device=x.device)
    flat_slots = slot_ids.reshape(-1)
    active = flat_slots > 0
    if not bool(active.any()):
        return out.to(x.dtype)
    pair_idx = torch.nonzero(active).squeeze(1)
    slots = flat_slots[pair_idx]
    order = torch.argsort(slots, stable=True)
    pair_idx, slots = pair_idx[order], slots[order]
    uniq, counts = torch.unique_consecutive(slots, return_counts=True)
    tokens = pair_idx // k
    w = weights.reshape(-1)[pair_idx].float()
    start = 0
    for s, n in zip(uniq.tolist(), counts.tolist(), strict=True):
        tok = tokens[start : start + n]
        xs = x.index_select(0, tok).float()
        h = xs @ A[s].float().t()
        ys = (h @ B[s].float().t()) * w[start : start + n, None]
        out.index_add_(0, tok, ys)
        start += n
    return out.to(x.dtype)
