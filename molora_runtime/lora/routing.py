"""Turn each request's RouteSpec into the per-token (slot, weight) table of one step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from molora_runtime.lora.hotset import HotSet
from molora_runtime.model.learned_gate import LearnedPlan
from molora_runtime.model.lora_context import LoRAContext
from molora_runtime.routes import RouteSpec, VocabRange

# (gate slot, expert slots, top-k, temperature) of a learned segment
Plan = tuple[int, tuple[int, ...], int, float]


@dataclass
class RouteSegment:
    """`token_ids` (this step's input ids of one request, in batch order) and its route."""

    route: RouteSpec
    token_ids: torch.Tensor


@dataclass
class SegmentRows:
    """One segment's rows of the step's table, filled by its route (a `RouteTable`): the
    hot-set turns the route's refs into slots."""

    hot_set: HotSet
    token_ids: torch.Tensor
    slots: torch.Tensor
    weights: torch.Tensor
    comp: torch.Tensor
    topk: torch.Tensor
    temp: torch.Tensor
    plan: Plan | None = None  # set by a learned route
    experts: tuple[int, ...] = ()  # set by a learned route: the slots its gate may pick

    @classmethod
    def empty(cls, hot_set: HotSet, token_ids: torch.Tensor, width: int) -> SegmentRows:
        """Rows that run the base model: no slot, no weight, no gate."""
        n = int(token_ids.shape[0])
        return cls(
            hot_set,
            token_ids,
            slots=torch.zeros(n, width, dtype=torch.long),
            weights=torch.zeros(n, width, dtype=torch.float32),
            comp=torch.full((n,), -1, dtype=torch.long),
            topk=torch.ones(n, dtype=torch.long),
            temp=torch.ones(n, dtype=torch.float32),
        )

    def every_token(self, columns: Sequence[tuple[str, float]]) -> None:
        for j, (name, w) in enumerate(columns):
            self.slots[:, j] = self.hot_set.slot_of(name)
            self.weights[:, j] = w

    def by_token_id(self, ranges: Sequence[VocabRange], default: str | None) -> None:
        self.slots[:, 0] = _vocab_slots(ranges, default, self.token_ids.cpu(), self.hot_set)
        self.weights[:, 0] = (self.slots[:, 0] > 0).float()

    def by_gate(self, composition: str, top_k: int | None, temperature: float | None) -> None:
        cslot = self.hot_set.comp_slot_of(composition)
        info = self.hot_set.composition_info(composition)
        k = top_k or info.top_k
        t = temperature or info.temperature
        self.comp[:] = cslot
        self.topk[:] = k
        self.temp[:] = t
        self.experts = tuple(self.hot_set.expert_slots(composition))
        self.plan = (cslot, self.experts, k, t)


def build_lora_context(
    segments: list[RouteSegment],
    hot_set: HotSet,
    width: int,
    device: torch.device,
    record_layers: bool = False,
) -> LoRAContext | None:
    """Build the step's LoRAContext; None when every token runs the base model alone."""
    if all(s.route.is_base for s in segments):
        return None
    rows: list[SegmentRows] = []
    for seg in segments:
        seg_rows = SegmentRows.empty(hot_set, seg.token_ids, width)
        seg.route.fill(seg_rows)
        rows.append(seg_rows)
    host_slots = torch.cat([r.slots for r in rows])
    ctx = LoRAContext(
        slot_ids=host_slots.to(device),
        weights=torch.cat([r.weights for r in rows]).to(device),
        backend=hot_set.backend,
        record_layers=record_layers,
    )
    used = set(host_slots[host_slots > 0].tolist())
    for r in rows:
        used.update(r.experts)
    ctx.lora_cells = hot_set.slots.cells_of(used)
    ctx.lora_layers = frozenset(layer for _, layer in ctx.lora_cells)
    if hot_set.backend.stacked:
        ctx.stacked_slots = stacked_range(used)
    plans = {r.plan for r in rows if r.plan is not None}
    if plans:  # some token's adapters are picked by a learned gate
        ctx.comp_idx = torch.cat([r.comp for r in rows]).to(device)
        ctx.top_k = torch.cat([r.topk for r in rows]).to(device)
        ctx.temperature = torch.cat([r.temp for r in rows]).to(device)
        ctx.gates = hot_set.gates
        if len(plans) == 1:
            ((cslot, experts, k, t),) = plans
            all_learned = all(s.route.is_learned for s in segments)
            ctx.learned_plan = LearnedPlan(cslot, len(experts), k, float(t), all_learned, experts)
    return ctx


def stacked_range(used: set[int]) -> tuple[int, int] | None:
    """The slot range the stacked delta covers: every slot this step's tokens can use."""
    if not used:
        return None
    first, last = min(used), max(used)
    return first, last - first + 1


def _vocab_slots(
    ranges: Sequence[VocabRange], default: str | None, token_ids: torch.Tensor, hot_set: HotSet
) -> torch.Tensor:
    """Each token's slot: its id's range's adapter, else the default (0 is the base model)."""
    ordered = sorted(ranges, key=lambda r: r.start)
    starts = torch.tensor([r.start for r in ordered], dtype=torch.long)
    ends = torch.tensor([r.end for r in ordered], dtype=torch.long)
    slots = torch.tensor(
        [hot_set.slot_of(r.adapter) if r.adapter else 0 for r in ordered], dtype=torch.long
    )
    default_slot = hot_set.slot_of(default) if default else 0
    idx = torch.searchsorted(starts, token_ids, right=True) - 1
    safe = idx.clamp(min=0)
    inside = (idx >= 0) & (token_ids < ends[safe])
    return torch.where(inside, slots[safe], torch.full_like(token_ids, default_slot))
