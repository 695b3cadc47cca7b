"""Gate telemetry folded on the device: routing entropy, top-1 weight and top-1 expert per layer.

For every step with learned tokens, `record` turns the forward's gate logits and tables into a
few per-layer sums and cumulative bucket counts per composition, and adds them into one device
accumulator per composition: no value is read back to the host until `pop`, which the replica
calls at its stats interval (one read-back per composition there, none per step).

- routing entropy: of the gate's softmax over the composition's experts (temperature applied),
  divided by log(experts), so 0 is a one-hot gate and 1 a uniform one (0 with one expert);
- top-1 weight: the mixture weight of a token's first expert after top-k (1 at top-1);
- top-1 expert: which expert each token ranks first (what a collapsed gate shows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from molora_runtime.lora.context import LoRAContext
from molora_runtime.lora.hotset import HotSet

# Prometheus `le` bounds of the two histograms (the +Inf bucket is the token count).
ENTROPY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
TOP1_BUCKETS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
_BE, _BW = len(ENTROPY_BUCKETS), len(TOP1_BUCKETS)


@dataclass
class LayerTelemetry:
    """One layer's routed tokens of a composition since the last `pop`."""

    tokens: int
    entropy_sum: float
    top1_weight_sum: float
    entropy_buckets: list[int]  # cumulative, one per ENTROPY_BUCKETS bound
    top1_weight_buckets: list[int]  # cumulative, one per TOP1_BUCKETS bound
    top1_expert: list[int]  # tokens that ranked each expert first


class GateTelemetry:
    """Per composition, a `[L, columns]` float64 device accumulator, read back on `pop`.

    Columns: tokens, entropy sum, top-1 weight sum, entropy buckets, top-1 weight buckets,
    top-1 expert counts. A composition whose expert count changed starts over.
    """

    def __init__(self, hot_set: HotSet) -> None:
        self.hot_set = hot_set
        self._acc: dict[str, torch.Tensor] = {}
        self._edges: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(self, ctx: LoRAContext) -> None:
        """Fold one step's learned tokens (needs `ctx.layer_logits` and `ctx.layer_tables`)."""
        if ctx.comp_idx is None or not ctx.layer_logits or not ctx.layer_tables:
            return
        logits = torch.stack(ctx.layer_logits)  # [L, T, >= n]
        top1_w = torch.stack([w[:, 0] for _, w in ctx.layer_tables]).float()  # [L, T]
        plan = ctx.learned_plan
        for comp in self.hot_set.compositions():
            c = self.hot_set.comp_slot_of(comp)
            if plan is not None and plan.comp_slot != c:
                continue  # the host knows this step has no token of it
            n = len(self.hot_set.composition_info(comp).experts)
            step = self._fold_one(logits[..., :n], top1_w, ctx.comp_idx == c, n)
            acc = self._acc.get(comp)
            if acc is None or acc.shape != step.shape:
                self._acc[comp] = step
            else:
                acc.add_(step)

    def _fold_one(
        self, logits: torch.Tensor, top1_w: torch.Tensor, mask: torch.Tensor, n: int
    ) -> torch.Tensor:
        L = logits.shape[0]
        ent_edges, w_edges = self._edges_on(logits.device)
        logp = torch.log_softmax(logits.float(), dim=-1)
        entropy = -(logp.exp() * logp).nan_to_num(0.0).sum(-1)  # [L, T]
        entropy = entropy / math.log(n) if n > 1 else torch.zeros_like(entropy)
        m = mask.to(torch.float64)[None, :]  # [1, T]
        first = torch.nn.functional.one_hot(logits.argmax(-1), n).to(torch.float64)  # [L, T, n]
        cols = [
            m.expand(L, -1).sum(1, keepdim=True),
            (entropy.double() * m).sum(1, keepdim=True),
            (top1_w.double() * m).sum(1, keepdim=True),
            ((entropy[..., None] <= ent_edges) * m[..., None]).sum(1),
            ((top1_w[..., None] <= w_edges) * m[..., None]).sum(1),
            (first * m[..., None]).sum(1),
        ]
        return torch.cat(cols, dim=1)

    def _edges_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._edges:
            # a hair above each bound, so a value computed as exactly the bound lands in it
            ent = torch.tensor(ENTROPY_BUCKETS, device=device) + 1e-6
            w = torch.tensor(TOP1_BUCKETS, device=device) + 1e-6
            self._edges[device] = (ent, w)
        return self._edges[device]

    def pop(self) -> dict[str, list[LayerTelemetry]]:
        """Everything folded since the last call, per composition and layer (then reset)."""
        out = {}
        for comp, acc in self._acc.items():
            rows = acc.cpu().tolist()
            out[comp] = [_layer(row) for row in rows]
        self._acc.clear()
        return out


def _layer(row: list[float]) -> LayerTelemetry:
    ent = 3 + _BE
    return LayerTelemetry(
        tokens=round(row[0]),
        entropy_sum=row[1],
        top1_weight_sum=row[2],
        entropy_buckets=[round(v) for v in row[3:ent]],
        top1_weight_buckets=[round(v) for v in row[ent : ent + _BW]],
        top1_expert=[round(v) for v in row[ent + _BW :]],
    )
