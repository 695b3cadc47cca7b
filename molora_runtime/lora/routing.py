"""Turn each request's RouteSpec into the per-token (slot, weight) table of one step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from molora_runtime.errors import InvalidRequestError
from molora_runtime.lora.context import LoRAContext
from molora_runtime.lora.hotset import HotSet
from molora_runtime.model.learned_gate import LearnedPlan
from molora_runtime.routes import (
    BaseRoute,
    LearnedRoute,
    MixRoute,
    RouteSpec,
    SingleRoute,
    VocabRoute,
)


@dataclass
class RouteSegment:
    """`token_ids` (this step's input ids of one request, in batch order) and its route."""

    route: RouteSpec
    token_ids: torch.Tensor


def route_adapters(route: RouteSpec) -> list[str]:
    """Adapters a static route needs resident (learned routes add their experts separately)."""
    return route.adapters()


def check_route_width(route: RouteSpec, width: int, composition_top_k: int | None = None) -> None:
    """Refuse routes that need more adapters per token than the table is wide."""
    if isinstance(route, MixRoute) and len(route.weights) > width:
        raise InvalidRequestError(
            f"a mix of {len(route.weights)} adapters exceeds hot_set.max_adapters_per_token={width}"
        )
    if isinstance(route, LearnedRoute):
        k = route.top_k or composition_top_k or 1
        if k > width:
            raise InvalidRequestError(f"top_k={k} exceeds hot_set.max_adapters_per_token={width}")


def build_lora_context(
    segments: list[RouteSegment],
    hot_set: HotSet,
    width: int,
    device: torch.device,
    record_layers: bool = False,
) -> LoRAContext | None:
    """Build the step's LoRAContext; None when every token runs the base model alone."""
    if all(isinstance(s.route, BaseRoute) for s in segments):
        return None
    slot_rows: list[torch.Tensor] = []
    weight_rows: list[torch.Tensor] = []
    comp_rows: list[torch.Tensor] = []
    topk_rows: list[torch.Tensor] = []
    temp_rows: list[torch.Tensor] = []
    any_learned = False
    # (gate slot, expert slots, top-k, temperature)
    plans: set[tuple[int, tuple[int, ...], int, float]] = set()
    for seg in segments:
        n = int(seg.token_ids.shape[0])
        slots = torch.zeros(n, width, dtype=torch.long)
        weights = torch.zeros(n, width, dtype=torch.float32)
        comp = torch.full((n,), -1, dtype=torch.long)
        topk = torch.ones(n, dtype=torch.long)
        temp = torch.ones(n, dtype=torch.float32)
        route = seg.route
        if isinstance(route, SingleRoute):
            slots[:, 0] = hot_set.slot_of(route.adapter)
            weights[:, 0] = 1.0
        elif isinstance(route, MixRoute):
            for j, (name, w) in enumerate(route.weights.items()):
                slots[:, j] = hot_set.slot_of(name)
                weights[:, j] = w
        elif isinstance(route, VocabRoute):
            slots[:, 0] = _vocab_slots(route, seg.token_ids.cpu(), hot_set)
            weights[:, 0] = (slots[:, 0] > 0).float()
        elif isinstance(route, LearnedRoute):
            any_learned = True
            cslot = hot_set.comp_slot_of(route.composition)
            info = hot_set.composition_info(route.composition)
            comp[:] = cslot
            topk[:] = route.top_k or info.top_k
            temp[:] = route.temperature or info.temperature
            plans.add((cslot, tuple(hot_set.expert_slots(route.composition)),
                       route.top_k or info.top_k, route.temperature or info.temperature))  # fmt: skip
        slot_rows.append(slots)
        weight_rows.append(weights)
        comp_rows.append(comp)
        topk_rows.append(topk)
        temp_rows.append(temp)
    host_slots = torch.cat(slot_rows)
    ctx = LoRAContext(
        slot_ids=host_slots.to(device),
        weights=torch.cat(weight_rows).to(device),
        backend=hot_set.backend,
        record_layers=record_layers,
    )
    used = set(host_slots[host_slots > 0].tolist())
    for seg in segments:
        if isinstance(seg.route, LearnedRoute):
            used.update(hot_set.expert_slots(seg.route.composition))
    ctx.lora_layers = hot_set.slots.layers_of(used)
    if hot_set.backend.stacked:
        ctx.stacked_slots = stacked_range(used)
    if any_learned:
        ctx.comp_idx = torch.cat(comp_rows).to(device)
        ctx.top_k = torch.cat(topk_rows).to(device)
        ctx.temperature = torch.cat(temp_rows).to(device)
        ctx.gates = hot_set.gates
        if len(plans) == 1:
            ((cslot, experts, k, t),) = plans
            all_learned = all(isinstance(s.route, LearnedRoute) for s in segments)
            ctx.learned_plan = LearnedPlan(cslot, len(experts), k, float(t), all_learned, experts)
    return ctx


def stacked_range(used: set[int]) -> tuple[int, int] | None:
    """The slot range the stacked delta covers: every slot this step's tokens can use."""
    if not used:
        return None
    first, last = min(used), max(used)
    return first, last - first + 1


def _vocab_slots(route: VocabRoute, token_ids: torch.Tensor, hot_set: HotSet) -> torch.Tensor:
    ranges = sorted(route.ranges, key=lambda r: r.start)
    starts = torch.tensor([r.start for r in ranges], dtype=torch.long)
    ends = torch.tensor([r.end for r in ranges], dtype=torch.long)
    slots = torch.tensor(
        [hot_set.slot_of(r.adapter) if r.adapter else 0 for r in ranges], dtype=torch.long
    )
    default = hot_set.slot_of(route.default) if route.default else 0
    idx = torch.searchsorted(starts, token_ids, right=True) - 1
    safe = idx.clamp(min=0)
    inside = (idx >= 0) & (token_ids < ends[safe])
    return torch.where(inside, slots[safe], torch.full_like(token_ids, default))
