"""Per-step segment plans: group (token, j) pairs by slot once, reuse them for every projection.

Sorting tokens by slot costs host syncs (nonzero, unique); the segmented variant would pay them
in each of the ~7 LoRA projections of every layer. A step's routing table is the same for all
projections of a layer (and, for static routes, of every layer), so the caller builds the plan
once per table (Punica/vLLM likewise prepare their segment metadata once per step) and
`routed_lora_planned` only runs the GEMMs. Same math as `routed_lora_segmented`; differentiable in
x and the weights the plan was built from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotGroup:
    slot: int
    tokens: torch.Tensor | None  # token rows using the slot; None = every row, in order
    weights: torch.Tensor | None  # [n, 1] fp32 per-row weight; None = all 1.0


@dataclass(frozen=True)
class SegmentPlan:
    num_tokens: int
    groups: tuple[SlotGroup, ...]


def build_segment_plan(slot_ids: torch.Tensor, weights: torch.Tensor) -> SegmentPlan:
    """Group the active (slot > 0) pairs of a [T, k] routing table by slot."""
    T, k = slot_ids.shape
    flat_slots = slot_ids.reshape(-1)
    active = flat_slots > 0
    pair_idx = torch.nonzero(active).squeeze(1)
    if pair_idx.numel() == 0:
        return SegmentPlan(T, ())
    slots = flat_slots[pair_idx]
    order = torch.argsort(slots, stable=True)
    pair_idx, slots = pair_idx[order], slots[order]
    uniq, counts = torch.unique_consecutive(slots, return_counts=True)
    tokens = pair_idx // k
    w = weights.reshape(-1)[pair_idx].float()
    keep_grad = w.requires_grad
    groups = []
    start = 0
    for s, n in zip(uniq.tolist(), counts.tolist(), strict=True):
        tok = tokens[start : start + n]
        gw = w[start : start + n, None]
        every_row = n == T and bool((tok == torch.arange(T, device=tok.device)).all())
        unit = not keep_grad and bool((gw == 1.0).all())
        groups.append(SlotGroup(s, None if every_row else tok, None if unit else gw))
        start += n
    return SegmentPlan(T, tuple(groups))


def routed_lora_planned(
    x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, plan: SegmentPlan
) -> torch.Tensor:
    """Routed LoRA delta [T, d_out] from a prebuilt plan (two GEMMs per used slot)."""
    out = torch.zeros(plan.num_tokens, B.shape[1], dtype=torch.float32, device=x.device)
    for g in plan.groups:
        xs = x.float() if g.tokens is None else x.index_select(0, g.tokens).float()
        ys = (xs @ A[g.slot].float().t()) @ B[g.slot].float().t()
        if g.weights is not None:
            ys = ys * g.weights
        out = out + ys if g.tokens is None else out.index_add(0, g.tokens, ys)
    return out.to(x.dtype)
