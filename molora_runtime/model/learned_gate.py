"""The learned-route gate of one layer for the common step: every learned token on one composition.

When a step's learned tokens all route through one composition with one top-k and one
temperature (known on the host when the step is built: `LearnedPlan`), a layer's table takes a
handful of small ops instead of the general per-token path: one `addmm` over that composition's
real experts only (no other compositions' rows, no masking of padding experts), top-k and a
softmax over `[T, n]` (top-1: an argmax and weight 1), one gather of the experts' slots. For the
stacked CPU backend it also builds every projection's slot gate from the top-k pairs in one op
(a weighted `embedding_bag` over a 0/1 expansion matrix; top-1: one row gather).
What does not change from step to step (the layers' gate views, the expansion matrix, the
padding) lives in a `PlanCache` on the gate table, so a decode step builds none of it again.
The general path (`LoRAContext._learned_table`) stays for mixed steps, CUDA graphs and training.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from kernels.stacked import SlotGate

CACHED_PLANS = 16  # plan caches kept per gate table (oldest dropped first)
CACHED_FILLS = 64  # constant fills kept per plan cache, one per step size seen


@dataclass
class LearnedPlan:
    """What the host knows of a step's learned tokens, fixed for the whole forward."""

    comp_slot: int  # the gate slot every learned token reads
    num_experts: int  # that composition's real experts
    top_k: int
    temperature: float
    all_learned: bool  # no token of the step takes a static route
    expert_slots: tuple[int, ...] = ()  # host copy of the experts' hot-set slots (cache key)
    cache: PlanCache | None = None  # set by the context on first use


@dataclass
class PlanCache:
    """A plan's step-independent parts, on the step's device (views stay valid: the gate
    table is written in place)."""

    weight_t: list[torch.Tensor]  # per layer `[d, n]`
    bias: list[torch.Tensor]  # per layer `[n]`
    experts: torch.Tensor  # [n] the experts' hot-set slots
    local_slots: torch.Tensor | None = None  # [n] expert -> column in the stacked slot range
    # the (rank, dtype) SlotGates the projections read, and the 0/1 matrix that expands an
    # expert into all of them at once: [n, Σ count·rank]
    ranks: list[tuple[int, torch.dtype]] = field(default_factory=list)
    expander: torch.Tensor | None = None
    fills: dict[tuple[int, int], Fill] = field(default_factory=dict)


@dataclass(frozen=True)
class Fill:
    """Constant `[T, width]` tensors a layer's table reuses: padding and top-1 weights."""

    zeros: torch.Tensor  # int64
    zeros_f: torch.Tensor  # float32
    ones_f: torch.Tensor  # float32


@dataclass
class LayerGate:
    """One layer's routing of the learned tokens: top-k experts, their weights, raw logits."""

    experts: torch.Tensor  # [T, k] expert index within the composition
    weights: torch.Tensor  # [T, k] float32, each row sums to 1
    logits: torch.Tensor  # [T, n] float32 gate logits, bias added, before temperature


def plan_cache(
    caches: dict[tuple, PlanCache], plan: LearnedPlan, weight: torch.Tensor, bias: torch.Tensor,
    expert_slots: torch.Tensor, stacked: tuple[int, int] | None,
) -> PlanCache:  # fmt: skip
    """The cache of `plan` in `caches` (`weight [C, L, K, d]`, `bias [C, L, K]`,
    `expert_slots [C, K]`: the gate table), made on first use."""
    key = (plan.comp_slot, plan.num_experts, plan.expert_slots, stacked)
    cache = caches.get(key)
    if cache is None:
        c, n = plan.comp_slot, plan.num_experts
        w, b = weight[c, :, :n], bias[c, :, :n]
        cache = PlanCache(
            [w[i].t() for i in range(w.shape[0])], list(b.unbind(0)), expert_slots[c, :n]
        )
        if stacked is not None:
            cache.local_slots = cache.experts - stacked[0]
        if len(caches) >= CACHED_PLANS:
            caches.pop(next(iter(caches)))
        caches[key] = cache
    return cache


def layer_gate(plan: LearnedPlan, cache: PlanCache, layer: int, normed: torch.Tensor) -> LayerGate:
    """Top-k experts and weights of every token for `layer`."""
    x = normed if normed.dtype == torch.float32 else normed.float()
    logits = torch.addmm(cache.bias[layer], x, cache.weight_t[layer])
    T, k = x.shape[0], min(plan.top_k, plan.num_experts)
    if k == 1:  # argmax is unchanged by a positive temperature, and one weight is 1
        return LayerGate(logits.argmax(dim=-1, keepdim=True), _fill(cache, T, 1).ones_f, logits)
    scaled = logits if plan.temperature == 1.0 else logits / plan.temperature
    vals, idx = torch.topk(scaled, k, dim=-1)
    return LayerGate(idx, torch.softmax(vals, dim=-1), logits)


def _fill(cache: PlanCache, T: int, width: int) -> Fill:
    fill = cache.fills.get((T, width))
    if fill is None:
        dev = cache.experts.device
        zeros = torch.zeros(T, width, dtype=torch.long, device=dev)
        fill = Fill(zeros, zeros.float(), torch.ones(T, width, device=dev))
        if len(cache.fills) >= CACHED_FILLS:
            cache.fills.pop(next(iter(cache.fills)))
        cache.fills[(T, width)] = fill
    return fill


def table_of(
    gate: LayerGate, cache: PlanCache, static: tuple[torch.Tensor, torch.Tensor],
    learned: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The step's `(slot_ids, weights)` table `[T, W]` for a layer: learned rows from `gate`,
    the others from `static`."""
    static_slots, static_w = static
    W, k = static_slots.shape[1], gate.experts.shape[1]
    slots, weights = cache.experts[gate.experts], gate.weights
    if k < W:
        fill = _fill(cache, slots.shape[0], W - k)
        slots = torch.cat((slots, fill.zeros), dim=1)
        weights = torch.cat((weights, fill.zeros_f), dim=1)
    if learned is None:
        return slots, weights.to(static_w.dtype)
    return (
        torch.where(learned[:, None], slots, static_slots),
        torch.where(learned[:, None], weights.to(static_w.dtype), static_w),
    )


def slot_weights(cache: PlanCache, gate: LayerGate, count: int) -> torch.Tensor:
    """Per-token weight of each slot of the stacked range `[T, count]` (all tokens learned)."""
    assert cache.local_slots is not None
    cols = cache.local_slots[gate.experts]
    out = torch.zeros(cols.shape[0], count, device=cols.device)
    return out.scatter_(1, cols, gate.weights)


def all_gates(
    cache: PlanCache, gate: LayerGate, count: int
) -> dict[tuple[int, torch.dtype], SlotGate]:
    """Every `SlotGate` the step's projections read, from one expansion of the top-k pairs
    (top-1: one row gather): each gate is a column block of one `[T, Σ count·rank]` table."""
    if not cache.ranks:
        return {}
    if cache.expander is None:
        cache.expander = _expander(cache, count)
    if gate.experts.shape[1] == 1:  # top-1: the weight is 1
        rows = F.embedding(gate.experts[:, 0], cache.expander)
    else:  # each column has one nonzero term, so the weighted sum is exact
        rows = F.embedding_bag(
            gate.experts, cache.expander, per_sample_weights=gate.weights, mode="sum"
        )
    inactive = rows == 0
    by_dtype = {torch.float32: rows}
    out, col = {}, 0
    for rank, dtype in cache.ranks:
        if dtype not in by_dtype:
            by_dtype[dtype] = rows.to(dtype)
        width = count * rank
        out[(rank, dtype)] = SlotGate(
            by_dtype[dtype][:, col : col + width], inactive[:, col : col + width]
        )
        col += width
    return out


def _expander(cache: PlanCache, count: int) -> torch.Tensor:
    """`[n, Σ count·rank]`: expert e's row is 1 on its slot's rank columns of every block."""
    assert cache.local_slots is not None
    eye = torch.eye(count, device=cache.local_slots.device)[cache.local_slots]  # [n, count]
    blocks = [eye.repeat_interleave(rank, dim=1) for rank, _ in cache.ranks]
    return torch.cat(blocks, dim=1)


def expand_gate(dense: torch.Tensor, rank: int, dtype: torch.dtype) -> SlotGate:
    """`SlotGate` of a `[T, count]` slot weight table for buffers of `rank` rows per slot."""
    T, count = dense.shape
    expanded = dense.unsqueeze(2).expand(T, count, rank).reshape(T, count * rank)
    return SlotGate(expanded if dtype == torch.float32 else expanded.to(dtype), expanded == 0)
