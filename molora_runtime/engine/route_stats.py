"""Routing observability: which adapters served a token (attribution) and gate statistics."""

from __future__ import annotations

import torch

from molora_runtime.engine.types import TokenAttribution
from molora_runtime.lora.context import LoRAContext
from molora_runtime.lora.hotset import HotSet


def slot_names(hot_set: HotSet) -> dict[int, str]:
    return {hot_set.slot_of(n): n for n in hot_set.loaded()}


def attribution(
    ctx: LoRAContext | None, index: int, token: int, names: dict[int, str]
) -> TokenAttribution:
    """Mean weight of each adapter over the layers for the token at batch row `index`."""
    if ctx is None or not ctx.layer_tables:
        return TokenAttribution(token_id=token, adapters={})
    slots = torch.stack([t[0][index] for t in ctx.layer_tables]).cpu()
    weights = torch.stack([t[1][index] for t in ctx.layer_tables]).float().cpu()
    totals: dict[str, float] = {}
    for s, w in zip(slots.flatten().tolist(), weights.flatten().tolist(), strict=True):
        if s > 0 and w != 0.0:
            name = names.get(s, f"slot{s}")
            totals[name] = totals.get(name, 0.0) + w
    n_layers = len(ctx.layer_tables)
    return TokenAttribution(
        token_id=token, adapters={k: round(v / n_layers, 4) for k, v in totals.items()}
    )


class GateStats:
    """Per composition, [layer][expert] token counts accumulated between `pop` calls."""

    def __init__(self, hot_set: HotSet) -> None:
        self.hot_set = hot_set
        self._counts: dict[str, torch.Tensor] = {}

    def record(self, ctx: LoRAContext) -> None:
        assert ctx.comp_idx is not None and ctx.gates is not None
        slots = torch.stack([t[0] for t in ctx.layer_tables])  # [L, T, W]
        weights = torch.stack([t[1] for t in ctx.layer_tables])
        for comp in self.hot_set.compositions():
            c = self.hot_set.comp_slot_of(comp)
            mask = ctx.comp_idx == c
            if not bool(mask.any()):
                continue
            k = int(ctx.gates.num_experts[c])
            experts = ctx.gates.expert_slots[c, :k]
            hit = (slots[:, mask, :, None] == experts) & (weights[:, mask, :, None] > 0)
            counts = hit.sum(dim=(1, 2)).cpu()  # [L, K]
            prev = self._counts.get(comp)
            self._counts[comp] = (
                counts if prev is None or prev.shape != counts.shape else prev + counts
            )

    def pop(self) -> dict[str, list[list[int]]]:
        out = {k: v.long().tolist() for k, v in self._counts.items()}
        self._counts.clear()
        return out
