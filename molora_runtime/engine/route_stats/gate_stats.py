"""Gate statistics: per composition, how many tokens each layer routed to each expert, queued on
the device each step and read back in bulk (plus the gate telemetry beside them)."""

from __future__ import annotations

import torch

from kernels.cpu_topk_route import route_stats_reference
from molora_runtime.engine.route_stats.gate_telemetry import GateTelemetry
from molora_runtime.lora.hotset import HotSet
from molora_runtime.model.learned_gate import stats_edges
from molora_runtime.model.lora_context import LoRAContext


class GateStats:
    """Per composition, [layer][expert] token counts accumulated between `pop` calls.

    `record` runs after every step with learned routes and must not stall the device: it only
    queues device tensors (the step's counts and how many tokens the composition had). The
    queue is read back — one sync for the lot — every `fold_every` records and on `pop`, where
    the folding rules are applied in order: a step without tokens of a composition is skipped,
    and a composition whose expert count changed starts over.
    """

    def __init__(self, hot_set: HotSet, fold_every: int = 64) -> None:
        self.hot_set = hot_set
        self.fold_every = fold_every
        self._counts: dict[str, torch.Tensor] = {}
        self._pending: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (comp, [L, K], seen)
        self.telemetry = GateTelemetry()  # entropy, top-1 weight and expert, per layer

    def record(self, ctx: LoRAContext) -> None:
        """Queue one step's routing: the route kernel's statistics where it folded them,
        else `route_stats_reference` on the recorded tables, per composition present."""
        assert ctx.comp_idx is not None and ctx.gates is not None
        plan, routed = ctx.learned_plan, ctx.routed_stats()
        slots, weights = ctx.recorded_tables()  # [L, T, W]
        logits = ctx.recorded_logits() if ctx.layer_logits else None  # [L, T, >= n]
        for comp in self.hot_set.compositions():
            c = self.hot_set.comp_slot_of(comp)
            if plan is not None and plan.comp_slot != c:
                continue  # the host knows this step has no token of it
            n = len(self.hot_set.composition_info(comp).experts)  # host copy of num_experts[c]
            step = routed  # the kernel's, of the plan's composition (the only one here)
            if step is None:
                mask = ctx.comp_idx == c  # [T]
                experts = ctx.gates.expert_slots[c, :n]
                selected = ((slots[..., None] == experts) & (weights > 0)[..., None]).sum(2)
                if logits is None:  # tables without logits (attribution only): counts alone
                    counts = (selected * mask[None, :, None]).sum(1)
                    self._pending.append((comp, counts, mask.sum()))
                    continue
                top1, edges = weights[..., 0].float(), stats_edges(mask.device)
                step = route_stats_reference(logits[..., :n], top1, selected, mask, *edges)
            self._pending.append((comp, step[:, -n:], step[0, 0]))
            self.telemetry.add(comp, step[:, :-n])
        if len(self._pending) >= self.fold_every:
            self._fold()

    def _fold(self) -> None:
        if not self._pending:
            return
        seen = torch.stack([n for _, _, n in self._pending]).tolist()
        for (comp, counts, _), n in zip(self._pending, seen, strict=True):
            if n == 0:
                continue
            counts = counts.cpu()
            prev = self._counts.get(comp)
            self._counts[comp] = (
                counts if prev is None or prev.shape != counts.shape else prev + counts
            )
        self._pending.clear()

    def pop(self) -> dict[str, list[list[int]]]:
        self._fold()
        out = {k: v.long().tolist() for k, v in self._counts.items()}
        self._counts.clear()
        return out
