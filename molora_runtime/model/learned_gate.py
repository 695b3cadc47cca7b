"""The learned-route gate of one layer for the common step: every learned token on one composition.

When a step's learned tokens all route through one composition with one top-k and one
temperature (known on the host when the step is built: `LearnedPlan`), a layer's table takes
one top-k route (`kernels.cpu_topk_route`: on CPU one kernel call, elsewhere its PyTorch twin)
instead of the general per-token path: the gate over that composition's real experts only (no
other compositions' rows, no masking of padding experts), top-k, softmax and the slot table,
which the CPU backend's grouped top-k delta reads as it is.
What does not change from step to step (the layers' gate views, the experts' slots) lives in a
`PlanCache` on the gate table.
The general path (`LoRAContext._learned_table`) stays for mixed steps, CUDA graphs and training.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.cpu_topk_route import Route, TopKRouter

CACHED_PLANS = 16  # plan caches kept per gate table (oldest dropped first)
CACHED_ROUTERS = 16  # routers kept per plan cache (oldest dropped first)
# Upper bounds of gate telemetry's two histograms (Prometheus `le`; +Inf is the token count).
ENTROPY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
TOP1_BUCKETS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
_EDGES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def stats_edges(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The histograms' bounds as route statistics compare them, on `device`: fp32, a hair
    above each bound, so a value computed as exactly the bound lands in it."""
    edges = _EDGES.get(device)
    if edges is None:
        edges = _EDGES[device] = (
            torch.tensor(ENTROPY_BUCKETS, device=device) + 1e-6,
            torch.tensor(TOP1_BUCKETS, device=device) + 1e-6,
        )
    return edges


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

    weight: list[torch.Tensor]  # per layer `[n, d]`
    bias: list[torch.Tensor]  # per layer `[n]`
    experts: torch.Tensor  # [n] the experts' hot-set slots
    # routers by (top_k, temperature, table width); few: one per setting
    routers: dict[tuple, TopKRouter] = field(default_factory=dict)


def plan_cache(
    caches: dict[tuple, PlanCache], plan: LearnedPlan, weight: torch.Tensor, bias: torch.Tensor,
    expert_slots: torch.Tensor,
) -> PlanCache:  # fmt: skip
    """The cache of `plan` in `caches` (`weight [C, L, K, d]`, `bias [C, L, K]`,
    `expert_slots [C, K]`: the gate table), made on first use."""
    key = (plan.comp_slot, plan.num_experts, plan.expert_slots)
    cache = caches.get(key)
    if cache is None:
        c, n = plan.comp_slot, plan.num_experts
        w, b = weight[c, :, :n], bias[c, :, :n]
        cache = PlanCache(list(w.unbind(0)), list(b.unbind(0)), expert_slots[c, :n])
        if len(caches) >= CACHED_PLANS:
            caches.pop(next(iter(caches)))
        caches[key] = cache
    return cache


def router_of(plan: LearnedPlan, cache: PlanCache, width: int) -> TopKRouter:
    """The plan's router for a `[T, width]` slot table, made on first use."""
    k = min(plan.top_k, plan.num_experts)
    key = (k, plan.temperature, width)
    router = cache.routers.get(key)
    if router is None:
        if len(cache.routers) >= CACHED_ROUTERS:
            cache.routers.pop(next(iter(cache.routers)))
        router = cache.routers[key] = TopKRouter(
            cache.weight, cache.bias, k, plan.temperature, cache.experts, width,
            stats_edges(cache.experts.device),
        )  # fmt: skip
    return router


def table_of(
    route: Route, static: tuple[torch.Tensor, torch.Tensor], learned: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's `(slot_ids, weights)` table `[T, W]` for a layer: learned rows from `route`,
    the others from `static`."""
    static_slots, static_w = static
    slots, weights = route.slot_ids, route.slot_weights.to(static_w.dtype)
    if learned is None:
        return slots, weights
    return (
        torch.where(learned[:, None], slots, static_slots),
        torch.where(learned[:, None], weights, static_w),
    )
