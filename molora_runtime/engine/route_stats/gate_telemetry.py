"""Gate telemetry folded on the device: routing entropy, top-1 weight and top-1 expert per layer.

For every step with learned tokens, `GateStats.record` hands `add` a few per-layer sums and
cumulative bucket counts per composition (the route kernel's statistics, or
`kernels.cpu_topk_route.route_stats_reference` on the step's tables), which it adds into one
device accumulator per composition: no value is read back to the host until `pop`, which the
replica calls at its stats interval (one read-back per composition there, none per step).

- routing entropy: of the gate's softmax over the composition's experts (temperature applied),
  divided by log(experts), so 0 is a one-hot gate and 1 a uniform one (0 with one expert);
- top-1 weight: the mixture weight of a token's first expert after top-k (1 at top-1);
- top-1 expert: which expert each token ranks first (what a collapsed gate shows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from molora_runtime.model.learned_gate import ENTROPY_BUCKETS, TOP1_BUCKETS

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

    def __init__(self) -> None:
        self._acc: dict[str, torch.Tensor] = {}

    def add(self, comp: str, step: torch.Tensor) -> None:
        """Add one step's `[L, columns]` telemetry of `comp` (route statistics' columns up to
        the top-1 expert counts)."""
        acc = self._acc.get(comp)
        if acc is None or acc.shape != step.shape:
            self._acc[comp] = step.clone()
        else:
            acc.add_(step)

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
