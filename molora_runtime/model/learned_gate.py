"""The learned-route gate of one layer for the common step: every learned token on one composition.

When a step's learned tokens all route through one composition with one top-k and one
temperature (known on the host when the step is built: `LearnedPlan`), a layer's table takes a
handful of small ops instead of the general per-token path: one `addmm` over that composition's
real experts only (no other compositions' rows, no masking of padding experts), top-k and a
softmax over `[T, n]` (top-1: an argmax and weight 1), one gather of the experts' slots. For the
stacked CPU backend it also builds the slot range's per-token weights `[T, count]` straight
from the top-k pairs (one scatter), so each projection's `SlotGate` is one expansion of it.
The general path (`LoRAContext._learned_table`) stays for mixed steps, CUDA graphs and training.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.stacked import SlotGate


@dataclass
class LearnedPlan:
    """What the host knows of a step's learned tokens, fixed for the whole forward."""

    comp_slot: int  # the gate slot every learned token reads
    num_experts: int  # that composition's real experts
    top_k: int
    temperature: float
    all_learned: bool  # no token of the step takes a static route
    # filled on first use, on the step's device
    local_slots: torch.Tensor | None = None  # [n] expert -> column in the stacked slot range
    ones: torch.Tensor | None = None  # [T, 1] top-1 weights
    # the (rank, dtype) SlotGates the step's projections asked for, and the 0/1 matrix that
    # expands an expert into all of them at once: [n, Σ count·rank]
    ranks: list[tuple[int, torch.dtype]] = field(default_factory=list)
    expander: torch.Tensor | None = None


@dataclass
class LayerGate:
    """One layer's routing of the learned tokens: top-k experts, their weights, raw logits."""

    experts: torch.Tensor  # [T, k] expert index within the composition
    weights: torch.Tensor  # [T, k] float32, each row sums to 1
    logits: torch.Tensor  # [T, n] float32 gate logits, bias added, before temperature


def layer_gate(
    plan: LearnedPlan, weight: torch.Tensor, bias: torch.Tensor, layer: int, normed: torch.Tensor
) -> LayerGate:
    """Top-k experts and weights of every token for `layer` (`weight [C, L, K, d]`, `bias [C, L, K]`)."""
    c, n = plan.comp_slot, plan.num_experts
    x = normed if normed.dtype == torch.float32 else normed.float()
    logits = torch.addmm(bias[c, layer, :n], x, weight[c, layer, :n].t())
    k = min(plan.top_k, n)
    if k == 1:  # argmax is unchanged by a positive temperature, and one weight is 1
        if plan.ones is None or plan.ones.shape[0] != x.shape[0]:
            plan.ones = torch.ones(x.shape[0], 1, device=x.device)
        return LayerGate(logits.argmax(dim=-1, keepdim=True), plan.ones, logits)
    scaled = logits if plan.temperature == 1.0 else logits / plan.temperature
    vals, idx = torch.topk(scaled, k, dim=-1)
    return LayerGate(idx, torch.softmax(vals, dim=-1), logits)


def table_of(
    gate: LayerGate, expert_slots: torch.Tensor, static: tuple[torch.Tensor, torch.Tensor],
    learned: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The step's `(slot_ids, weights)` table `[T, W]` for a layer: learned rows from `gate`
    (`expert_slots [n]` the composition's adapter slots), the others from `static`."""
    static_slots, static_w = static
    W, k = static_slots.shape[1], gate.experts.shape[1]
    slots, weights = expert_slots[gate.experts], gate.weights
    if k < W:
        slots = torch.nn.functional.pad(slots, (0, W - k))
        weights = torch.nn.functional.pad(weights, (0, W - k))
    if learned is None:
        return slots, weights.to(static_w.dtype)
    return (
        torch.where(learned[:, None], slots, static_slots),
        torch.where(learned[:, None], weights.to(static_w.dtype), static_w),
    )


def slot_weights(plan: LearnedPlan, gate: LayerGate, count: int) -> torch.Tensor:
    """Per-token weight of each slot of the stacked range `[T, count]` (all tokens learned)."""
    assert plan.local_slots is not None
    cols = plan.local_slots[gate.experts]
    out = torch.zeros(cols.shape[0], count, device=cols.device)
    return out.scatter_(1, cols, gate.weights)


def all_gates(
    plan: LearnedPlan, gate: LayerGate, count: int
) -> dict[tuple[int, torch.dtype], SlotGate]:
    """Every `SlotGate` the step's projections read, from one expansion of the top-k pairs
    (top-1: one row gather): each gate is a column block of one `[T, Σ count·rank]` table."""
    if not plan.ranks:
        return {}
    if plan.expander is None:
        plan.expander = _expander(plan, count)
    if gate.experts.shape[1] == 1:  # top-1: the weight is 1
        rows = plan.expander[gate.experts[:, 0]]
    else:  # each column has one nonzero term, so the sum is exact
        rows = (plan.expander[gate.experts] * gate.weights.unsqueeze(2)).sum(dim=1)
    inactive = rows == 0
    by_dtype = {torch.float32: rows}
    out, col = {}, 0
    for rank, dtype in plan.ranks:
        if dtype not in by_dtype:
            by_dtype[dtype] = rows.to(dtype)
        width = count * rank
        out[(rank, dtype)] = SlotGate(
            by_dtype[dtype][:, col : col + width], inactive[:, col : col + width]
        )
        col += width
    return out


def _expander(plan: LearnedPlan, count: int) -> torch.Tensor:
    """`[n, Σ count·rank]`: expert e's row is 1 on its slot's rank columns of every block."""
    assert plan.local_slots is not None
    eye = torch.eye(count, device=plan.local_slots.device)[plan.local_slots]  # [n, count]
    blocks = [eye.repeat_interleave(rank, dim=1) for rank, _ in plan.ranks]
    return torch.cat(blocks, dim=1)


def expand_gate(dense: torch.Tensor, rank: int, dtype: torch.dtype) -> SlotGate:
    """`SlotGate` of a `[T, count]` slot weight table for buffers of `rank` rows per slot."""
    T, count = dense.shape
    expanded = dense.unsqueeze(2).expand(T, count, rank).reshape(T, count * rank)
    return SlotGate(expanded if dtype == torch.float32 else expanded.to(dtype), expanded == 0)
