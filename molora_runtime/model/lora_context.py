"""Per-step LoRA routing metadata handed down the forward (never module-global state).

It lives in `model/` because the model reads it; `lora/` builds it (lora imports model, never the
reverse). It also names the engine's LoRA backend, so every LoRA-targeted layer makes one call,
`ctx.add_lora(y, x, buffers, layer)`.

`LoRAContext` carries, for the T tokens of a step, the static per-token table
`(slot_ids[T, W], weights[T, W])` built from each request's route, plus — for tokens on a
learned route — which composition gates them. At the top of every decoder layer the model calls
`begin_layer`, which runs the composition gates on that layer's normed input and overwrites the
learned tokens' rows; every LoRA-targeted linear of the layer then reads `slot_ids`/`weights`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kernels.cpu_topk_route import RouteTables, TopKRouter
from kernels.device_plan import DevicePlan, build_device_plan
from kernels.stacked import SlotGate, slot_gate
from molora_runtime.model.learned_gate import (
    LearnedPlan,
    PlanCache,
    plan_cache,
    router_of,
    table_of,
)


class Backend(Protocol):
    """What a layer calls to add its routed delta (`molora_runtime.model.lora_backend`)."""

    def add(
        self, y: torch.Tensor, x: torch.Tensor, buffers: Any, layer: int, ctx: LoRAContext
    ) -> torch.Tensor: ...


@dataclass
class GateTable:
    """The composition slots of the hot-set, as the model sees them during a forward.

    weight: [C, L, K, d]; bias: [C, L, K]; expert_slots: [C, K] hot-set slot of each expert
    (0 for padding experts); num_experts: [C].
    """

    weight: torch.Tensor
    bias: torch.Tensor
    expert_slots: torch.Tensor
    num_experts: torch.Tensor
    # the fast path's step-independent parts per plan (`learned_gate.plan_cache`)
    plans: dict[tuple, PlanCache] = field(default_factory=dict)


@dataclass
class LoRAContext:
    """Routing of one forward's tokens; `None` in place of a context means base model only."""

    slot_ids: torch.Tensor  # [T, W] int64, <= 0 = none
    weights: torch.Tensor  # [T, W] float32
    backend: Backend | None = None  # the engine's LoRA backend (None: no layer reads this context)
    comp_idx: torch.Tensor | None = None  # [T] int64 composition slot, -1 = static route
    gates: GateTable | None = None
    top_k: torch.Tensor | None = None  # [T] int64, learned tokens' top-k
    temperature: torch.Tensor | None = None  # [T] float32, learned tokens' gate temperature
    # Slots [first, first + count) hold every adapter this step can touch (the stacked backend).
    stacked_slots: tuple[int, int] | None = None
    # layers where some slot this step can touch holds weights (None: every layer); elsewhere
    # every delta is exactly 0, so no projection computes one
    lora_layers: frozenset[int] | None = None
    # (buffers id, layer) cells some slot this step can touch holds weights for (None: every
    # cell); a projection whose cell is not here adds exactly 0, so it computes nothing
    lora_cells: frozenset[tuple[int, int]] | None = None
    # every learned token on one composition (host-known): the layer's gate takes the fast path
    learned_plan: LearnedPlan | None = None
    gated: bool = False  # a learned gate writes rows of this table (kept by a rank pool's view)
    record_layers: bool = False  # keep each layer's table (attribution / gate statistics)
    return_gate_logits: bool = False  # keep raw gate logits (router training)
    # outputs of the forward, filled by begin_layer
    layer_tables: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    gate_logits: list[torch.Tensor] = field(default_factory=list)
    # with record_layers, each layer's tempered gate logits [T, >= n] (gate telemetry)
    layer_logits: list[torch.Tensor] = field(default_factory=list)
    _static: tuple[torch.Tensor, torch.Tensor] | None = None
    # per table: (slot_ids, weights, {(rank, dtype): SlotGate})
    _gates: tuple[torch.Tensor, torch.Tensor, dict[tuple[int, torch.dtype], SlotGate]] | None = None
    _device_plan: tuple[torch.Tensor, torch.Tensor, DevicePlan] | None = None
    # the fast path's routes of every layer, written in place (`_fast_table`), and how many
    _router: TopKRouter | None = None
    _routes: RouteTables | None = None
    _routed_layers: int = 0
    _stacked: dict[str, Any] = field(default_factory=dict)  # `recorded_*`, built once

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, buffers: Any, layer: int) -> torch.Tensor:
        """`y` plus the routed delta of `x` over `buffers` (in place where autograd allows)."""
        if self.lora_cells is not None:
            if (id(buffers), layer) not in self.lora_cells:
                return y
        elif self.lora_layers is not None and layer not in self.lora_layers:
            return y
        assert self.backend is not None, "a serving or training context names its backend"
        return self.backend.add(y, x, buffers, layer, self)

    def slot_gate(self, rank: int, dtype: torch.dtype) -> SlotGate:
        """The stacked delta's gate over `stacked_slots` for buffers of this rank and dtype.

        Built once per routing table (once per step for static routes, once per layer for
        learned ones where the grouped kernel does not run) and shared by every projection that
        reads it; a fused group's rank is its members' ranks together.
        """
        assert self.stacked_slots is not None
        first, count = self.stacked_slots
        cached = self._gates
        if cached is None or cached[0] is not self.slot_ids or cached[1] is not self.weights:
            cached = self._gates = (self.slot_ids, self.weights, {})
        gate = cached[2].get((rank, dtype))
        if gate is None:
            gate = slot_gate(self.slot_ids, self.weights, first, count, rank, dtype)
            cached[2][(rank, dtype)] = gate
        return gate

    def kernel_meta(self) -> DevicePlan | None:
        """The current table as the Triton kernels read it (CUDA), built once per table."""
        if not self.slot_ids.is_cuda:
            return None
        cached = self._device_plan
        if cached is None or cached[0] is not self.slot_ids or cached[1] is not self.weights:
            plan = build_device_plan(self.slot_ids, self.weights)
            cached = (self.slot_ids, self.weights, plan)
            self._device_plan = cached
        return cached[2]

    @property
    def has_learned(self) -> bool:
        return self.comp_idx is not None and self.gates is not None

    @property
    def learned_routes(self) -> bool:
        """Whether a learned gate writes rows of this step's table."""
        return self.gated or self.learned_plan is not None or self.has_learned

    def begin_layer(self, layer: int, normed: torch.Tensor) -> None:
        """Compute this layer's per-token table (learned rows from the gates on `normed`)."""
        if self._static is None:
            self._static = (self.slot_ids, self.weights)
        idle = self.lora_layers is not None and layer not in self.lora_layers
        if idle and not (self.record_layers or self.return_gate_logits):
            return  # no projection of this layer reads the table
        if self.has_learned and self.learned_plan is not None:
            self._fast_table(layer, normed)
        elif self.has_learned:
            self.slot_ids, self.weights = self._learned_table(layer, normed)
        if self.record_layers:
            self.layer_tables.append((self.slot_ids, self.weights))

    def _fast_table(self, layer: int, normed: torch.Tensor) -> None:
        """`learned_gate`'s path: one composition, one top-k, one temperature. Where the kernel
        runs, each layer's route lands in one step-wide `RouteTables` (no allocation per
        layer), static tokens keeping their own rows."""
        plan, static = self.learned_plan, self._static
        assert plan is not None and static is not None
        x = normed if normed.dtype == torch.float32 else normed.float()
        router = self._router
        if router is None:  # the first layer of the step
            g = self.gates
            assert g is not None
            cache = plan.cache
            if cache is None:
                cache = plan.cache = plan_cache(g.plans, plan, g.weight, g.bias, g.expert_slots)
            router = self._router = router_of(plan, cache, static[0].shape[1])
            if router.writes_in_place(x):
                rows = None if plan.all_learned else (self.comp_idx >= 0, *static)  # type: ignore[operator]
                self._routes = router.tables(x.shape[0], rows)
        routes = self._routes
        if routes is not None:
            router.route_into(layer, x, routes)
            self._routed_layers += 1
            self.slot_ids, self.weights = routes.slot_ids[layer], routes.slot_weights[layer]
            logits = routes.logits[layer]
        else:
            route = router(layer, x)
            learned = None if plan.all_learned else self.comp_idx >= 0  # type: ignore[operator]
            self.slot_ids, self.weights = table_of(route, static, learned)
            logits = route.logits
        if self.record_layers or self.return_gate_logits:
            t = plan.temperature
            tempered = logits if t == 1.0 else logits / t
            if self.record_layers:
                self.layer_logits.append(tempered)
            if self.return_gate_logits:
                self.gate_logits.append(tempered)

    def recorded_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The recorded layers' tables stacked: `(slot_ids, weights)`, each `[L, T, W]` (read
        straight from the step's `RouteTables` where every layer was routed into them)."""
        got = self._stacked.get("tables")
        if got is None:
            routes = self._routes
            if routes is not None and self._routed_layers == len(self.layer_tables):
                got = (routes.slot_ids, routes.slot_weights)
            else:
                got = (
                    torch.stack([s for s, _ in self.layer_tables]),
                    torch.stack([w for _, w in self.layer_tables]),
                )
            self._stacked["tables"] = got
        return got

    def routed_stats(self) -> torch.Tensor | None:
        """The step's route statistics `[L, columns]` as the route kernel folded them
        (`kernels.cpu_topk_route.route_stats_reference`'s columns, the plan's composition, its
        tokens), where it routed every recorded layer; None otherwise."""
        routes = self._routes
        if routes is None or not self.layer_tables or self._routed_layers != len(self.layer_tables):
            return None
        return routes.stats

    def recorded_logits(self) -> torch.Tensor:
        """The recorded layers' tempered gate logits stacked `[L, T, >= n]`."""
        got = self._stacked.get("logits")
        if got is None:
            routes, plan = self._routes, self.learned_plan
            if routes is not None and self._routed_layers == len(self.layer_logits):
                assert plan is not None
                t = plan.temperature
                got = routes.logits if t == 1.0 else routes.logits / t
            else:
                got = torch.stack(self.layer_logits)
            self._stacked["logits"] = got
        return got

    def _learned_table(self, layer: int, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.comp_idx is not None and self.gates is not None and self._static is not None
        assert self.top_k is not None and self.temperature is not None
        g = self.gates
        static_slots, static_w = self._static
        C, _, K, d = g.weight.shape
        W = static_slots.shape[1]
        learned = self.comp_idx >= 0
        comp = self.comp_idx.clamp(min=0)
        # Gate logits of every composition slot for every token, then pick the token's own.
        all_logits = normed.float() @ g.weight[:, layer].reshape(C * K, d).t()
        logits = (
            all_logits.view(-1, C, K).gather(1, comp.view(-1, 1, 1).expand(-1, 1, K)).squeeze(1)
        )
        logits = (logits + g.bias[comp, layer]) / self.temperature.unsqueeze(1)
        expert_range = torch.arange(K, device=logits.device)
        logits = logits.masked_fill(
            expert_range[None, :] >= g.num_experts[comp][:, None], float("-inf")
        )
        if self.return_gate_logits:
            self.gate_logits.append(logits)
        if self.record_layers:
            self.layer_logits.append(logits)
        k_max = min(W, K)
        top_vals, top_idx = torch.topk(logits, k_max, dim=-1)
        keep = torch.arange(k_max, device=logits.device)[None, :] < self.top_k[:, None]
        top_vals = top_vals.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(top_vals, dim=-1)
        slots = g.expert_slots[comp].gather(1, top_idx).masked_fill(~keep, 0)
        if k_max < W:
            pad = W - k_max
            slots = torch.nn.functional.pad(slots, (0, pad))
            probs = torch.nn.functional.pad(probs, (0, pad))
        slot_ids = torch.where(learned[:, None], slots, static_slots)
        weights = torch.where(learned[:, None], probs.to(static_w.dtype), static_w)
        return slot_ids, weights
