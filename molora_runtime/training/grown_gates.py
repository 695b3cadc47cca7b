"""A grown composition's gates: the frozen gates of its K experts plus one trainable row per layer
for the expert being added, so `compose add` trains only that row and the served routes of the
old experts stay as they were."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from molora_runtime.model.lora_context import GateTable
from molora_runtime.training.experts import Gates


@dataclass
class GrownGates:
    """A composition's frozen gates [L, K, d] plus one trainable row per layer (expert K+1)."""

    old_weight: torch.Tensor  # [L, K, d], frozen
    old_bias: torch.Tensor  # [L, K], frozen
    new_weight: torch.nn.Parameter  # [L, 1, d]
    new_bias: torch.nn.Parameter  # [L, 1]
    routing: dict[str, float] = field(default_factory=dict)  # the calibration's shares

    @classmethod
    def extend(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> GrownGates:
        """The new row starts as the mean of the old rows (`prototype_init` then aims it): its
        logit is the old logits' mean, never above the top-1 one, so the served top-1 route is
        unchanged and the row starts neither dominant nor dead."""
        weight = weight.detach().float()
        bias = torch.zeros(weight.shape[:2]) if bias is None else bias.detach().float()
        bias = bias.to(weight.device)
        return cls(
            old_weight=weight,
            old_bias=bias,
            new_weight=torch.nn.Parameter(weight.mean(dim=1, keepdim=True).clone()),
            new_bias=torch.nn.Parameter(bias.mean(dim=1, keepdim=True).clone()),
        )

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([self.old_weight, self.new_weight], dim=1)

    @property
    def bias(self) -> torch.Tensor:
        return torch.cat([self.old_bias, self.new_bias], dim=1)

    @property
    def new_index(self) -> int:
        return self.old_weight.shape[1]

    def params(self) -> dict[str, torch.nn.Parameter]:
        """The only tensors the optimizer sees."""
        return {"gate.new_weight": self.new_weight, "gate.new_bias": self.new_bias}

    def table(self) -> GateTable:
        return Gates(self.weight, self.bias).table()  # type: ignore[arg-type]
