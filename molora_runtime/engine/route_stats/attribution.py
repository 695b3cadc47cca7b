"""Attribution: which adapters served a token, each one's mean weight over the layers, read from
the step's recorded route tables (one device read for the whole batch)."""

from __future__ import annotations

import torch

from molora_runtime.engine.types import TokenAttribution
from molora_runtime.lora.hotset import HotSet
from molora_runtime.model.lora_context import LoRAContext


def slot_names(hot_set: HotSet) -> dict[int, str]:
    """The adapter name of every occupied hot-set slot, as attribution names them."""
    return {hot_set.slot_of(n): n for n in hot_set.loaded()}


def attribution(
    ctx: LoRAContext | None, index: int, token: int, names: dict[int, str]
) -> TokenAttribution:
    """Mean weight of each adapter over the layers for the token at batch row `index`."""
    return attributions(ctx, [index], [token], names)[0]


def attributions(
    ctx: LoRAContext | None, rows: list[int], tokens: list[int], names: dict[int, str]
) -> list[TokenAttribution]:
    """`attribution` of several rows with one device→host read for all of them (not 2 a row)."""
    if ctx is None or not ctx.layer_tables or not rows:
        return [TokenAttribution(token_id=t, adapters={}) for t in tokens]
    all_slots, all_weights = ctx.recorded_tables()  # [L, T, W]
    index = torch.tensor(rows, dtype=torch.long, device=all_slots.device)
    slots = all_slots.index_select(1, index)  # [L, R, W]
    weights = all_weights.index_select(1, index).float()
    # slot ids are small integers: exact in fp32, so both ride in one transfer
    both = torch.stack([slots.float(), weights]).cpu()
    n_layers = len(ctx.layer_tables)
    out = []
    for r, token in enumerate(tokens):
        totals: dict[str, float] = {}
        row_slots = both[0, :, r].flatten().long().tolist()
        row_weights = both[1, :, r].flatten().tolist()
        for s, w in zip(row_slots, row_weights, strict=True):
            if s > 0 and w != 0.0:
                name = names.get(s, f"slot{s}")
                totals[name] = totals.get(name, 0.0) + w
        out.append(
            TokenAttribution(
                token_id=token, adapters={k: round(v / n_layers, 4) for k, v in totals.items()}
            )
        )
    return out
