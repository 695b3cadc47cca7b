"""Routed LoRA over one layer's slots stacked as a single wide adapter (the CPU path).

When a layer's slot buffers are laid out slot-major and contiguous, `A_flat [S·r, d_in]` and
`Bt_flat [S·r, d_out]` are views, and the delta of a whole mixed batch is two GEMMs and one
selection, whatever adapters its tokens use:

    h = x A_flatᵀ                          [T, S·r]
    h = where(gate.inactive, 0, h · gate.weights)   (a token keeps only its own slots' columns)
    y += h Bt_flat

Work grows with the number of slots S, not with how many distinct adapters a batch mixes, and
there is no data-dependent control flow, so on a CPU, where a decode step is bound by per-op
overhead, it beats grouping tokens by slot. The selection (not a multiplication by 0) keeps a
slot a token does not use out of that token's row even if the slot's shrink overflowed; with
finite slot contents (the slot buffers refuse anything else) the expand then adds exact zeros.
Same math as `kernels.reference.routed_lora_dense` (its correctness twin).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotGate:
    """Per-token weight of each slot of a range, rank-expanded: `weights [T, count·rank]` in the
    GEMMs' dtype and `inactive`, where a token does not use the slot (a zero weight)."""

    weights: torch.Tensor
    inactive: torch.Tensor


def slot_gate(
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    first_slot: int,
    num_slots: int,
    rank: int,
    dtype: torch.dtype = torch.float32,
) -> SlotGate:
    """The `SlotGate` of slots `[first_slot, first_slot + num_slots)` for a `[T, k]` table.

    Column `i·rank + j` holds the summed weight the token gives slot `first_slot + i`; ids
    outside the range (and ids <= 0) contribute nothing.
    """
    T = slot_ids.shape[0]
    local = slot_ids.long() - first_slot
    inside = (local >= 0) & (local < num_slots) & (slot_ids > 0)
    w = torch.where(inside, weights.float(), torch.zeros((), device=weights.device))
    gate = torch.zeros(T, num_slots, dtype=torch.float32, device=slot_ids.device)
    gate.scatter_add_(1, local.clamp(0, max(num_slots - 1, 0)), w)
    expanded = gate.repeat_interleave(rank, dim=1)
    return SlotGate(expanded.to(dtype), expanded == 0)


def _select(h: torch.Tensor, gate: SlotGate) -> torch.Tensor:
    """`h · weights` where the token uses the slot, exactly 0 elsewhere."""
    if torch.is_grad_enabled() and (h.requires_grad or gate.weights.requires_grad):
        return torch.where(gate.inactive, 0.0, h * gate.weights.to(h.dtype))
    return h.mul_(gate.weights.to(h.dtype)).masked_fill_(gate.inactive, 0.0)


def routed_lora_stacked(
    x: torch.Tensor,
    A_flat: torch.Tensor,
    Bt_flat: torch.Tensor,
    gate: SlotGate,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Add the routed delta of `x [T, d_in]` to `out [T, d_out]` (or return it).

    `A_flat [S·r, d_in]`, `Bt_flat [S·r, d_out]` and `gate` share one slot range. The GEMMs run
    in `x.dtype` (the base projection's precision); `out` may be a strided view of a fused
    projection's output.
    """
    h = _select(x @ A_flat.t(), gate)
    if out is None:
        return h @ Bt_flat
    return out.addmm_(h, Bt_flat)


def routed_lora_stacked_group(
    x: torch.Tensor,
    A_flat: torch.Tensor,
    member_Bt: list[tuple[torch.Tensor, int]],
    rank: int,
    gate: SlotGate,
    out: torch.Tensor,
) -> torch.Tensor:
    """`routed_lora_stacked` (its twin) for a fused projection group, expanded per member.

    `A_flat [S·n·r, d_in]` holds, slot after slot, the n targeted members' A rows back to back
    (one shrink for the whole group); `member_Bt` holds each member's own `Bt_flat [S·r, w]`
    and the first column of its block in `out [T, D]`. Each member's expand multiplies only its
    own rank rows into a strided column view of `out`. `gate` is `slot_gate` at rank n·r.
    """
    h = x @ A_flat.t()
    T, n = h.shape[0], len(member_Bt)
    slots = h.shape[1] // (n * rank)

    def member_major(t: torch.Tensor) -> torch.Tensor:
        return t.view(T, slots, n, rank).transpose(1, 2)

    # Scale and regroup member-major in one op: member i's rank rows of every slot become one
    # column block of `by_member`, which its expand reads as a strided matrix without a copy.
    w = member_major(gate.weights.to(h.dtype))
    if torch.is_grad_enabled() and (h.requires_grad or w.requires_grad):
        by_member = torch.where(member_major(gate.inactive), 0.0, member_major(h) * w).contiguous()
    else:
        by_member = torch.empty(T, n, slots, rank, dtype=h.dtype, device=h.device)
        torch.mul(member_major(h), w, out=by_member)
        by_member.masked_fill_(member_major(gate.inactive), 0.0)
    by_member = by_member.view(T, n, slots * rank)
    for i, (bt_flat, first_col) in enumerate(member_Bt):
        out[:, first_col : first_col + bt_flat.shape[1]].addmm_(by_member[:, i], bt_flat)
    return out
