"""Routed LoRA over one layer's slots stacked as a single wide adapter (the CPU decode path).

When a layer's slot buffers are laid out slot-major and contiguous, `A_flat [S·r, d_in]` and
`Bt_flat [S·r, d_out]` are views, and the delta of a whole mixed batch is two GEMMs and one
scale, whatever adapters its tokens use:

    h = x A_flatᵀ            [T, S·r]
    h *= slot_weights ⊗ 1_r  (each token's weight for each slot, repeated over the rank)
    y += h Bt_flat

Work grows with the number of slots S, not with how many distinct adapters a batch mixes, and
there is no data-dependent control flow (no sorting, no per-slot loop, no host sync), so on a
CPU, where a step is bound by per-op overhead at decode sizes, it beats grouping tokens by slot
as long as S·r stays small next to the projection's width. Same math as
`kernels.reference.routed_lora_dense` (its correctness twin).
"""

from __future__ import annotations

import torch


def slot_weight_matrix(
    slot_ids: torch.Tensor, weights: torch.Tensor, first_slot: int, num_slots: int, rank: int
) -> torch.Tensor:
    """Per-token weight of each slot in `[first_slot, first_slot + num_slots)`, rank-expanded.

    Returns `[T, num_slots · rank]` in fp32: column `i·rank + j` holds the summed weight the
    token gives slot `first_slot + i`. Ids outside the range (and ids <= 0) contribute nothing.
    """
    T = slot_ids.shape[0]
    local = slot_ids.long() - first_slot
    inside = (local >= 0) & (local < num_slots) & (slot_ids > 0)
    w = torch.where(inside, weights.float(), torch.zeros((), device=weights.device))
    gate = torch.zeros(T, num_slots, dtype=torch.float32, device=slot_ids.device)
    gate.scatter_add_(1, local.clamp(0, max(num_slots - 1, 0)), w)
    return gate.repeat_interleave(rank, dim=1)


def routed_lora_stacked(
    x: torch.Tensor,
    A_flat: torch.Tensor,
    Bt_flat: torch.Tensor,
    expanded_weights: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Add the routed delta of `x [T, d_in]` to `out [T, d_out]` (or return it).

    `A_flat [S·r, d_in]`, `Bt_flat [S·r, d_out]` and `expanded_weights [T, S·r]` (from
    `slot_weight_matrix`) share one slot range. The GEMMs run in `x.dtype` (the base
    projection's precision); `out` may be a strided view of a fused projection's output.
    """
    h = x @ A_flat.t()
    h = h * expanded_weights.to(h.dtype)
    if out is None:
        return h @ Bt_flat
    return out.addmm_(h, Bt_flat)


def routed_lora_stacked_group(
    x: torch.Tensor,
    A_flat: torch.Tensor,
    member_Bt: list[tuple[torch.Tensor, int]],
    rank: int,
    expanded_weights: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """`routed_lora_stacked` (its twin) for a fused projection group, expanded per member.

    `A_flat [S·n·r, d_in]` holds, slot after slot, the n targeted members' A rows back to back
    (one shrink for the whole group); `member_Bt` holds each member's own `Bt_flat [S·r, w]`
    and the first column of its block in `out [T, D]`. The twin's block-structured expand
    multiplies every member's rank rows by every member's columns, n-1 of n of them zeros; here
    each member multiplies only its own (1/n of the expand flops), into a strided column view
    of `out`. `expanded_weights [T, S·n·r]` is `slot_weight_matrix` at rank n·r.
    """
    h = x @ A_flat.t()
    T, n = h.shape[0], len(member_Bt)
    slots = h.shape[1] // (n * rank)
    # Scale and regroup member-major in one op: member i's rank rows of every slot become one
    # column block of `by_member`, which its expand reads as a strided matrix without a copy
    # (slot-major, each member would need a copy of its own rows: n ops instead of one).
    h_view = h.view(T, slots, n, rank).transpose(1, 2)
    w_view = expanded_weights.to(h.dtype).view(T, slots, n, rank).transpose(1, 2)
    if torch.is_grad_enabled() and (h.requires_grad or w_view.requires_grad):
        by_member = (h_view * w_view).contiguous()  # `out=` does not differentiate
    else:
        by_member = torch.empty(T, n, slots, rank, dtype=h.dtype, device=h.device)
        torch.mul(h_view, w_view, out=by_member)
    by_member = by_member.view(T, n, slots * rank)
    for i, (bt_flat, first_col) in enumerate(member_Bt):
        out[:, first_col : first_col + bt_flat.shape[1]].addmm_(by_member[:, i], bt_flat)
    return out
