"""Per-table kernel metadata for the Triton path, built once per routing table on the device.

A step's routing table is shared by every LoRA projection of a layer (of every layer, for static
routes). The BGMV kernels read the table as contiguous int32 ids and weights; SGMV additionally
needs the (token, j) pairs sorted into (j, slot) segments. Both are built here once per table
(the caller caches the plan with the table) instead of once per projection, with device ops only
(no `.item()`, no host sync), so the whole step stays CUDA-graph capturable. No triton import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

PairGroups = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def group_pairs(slot_ids: torch.Tensor, weights: torch.Tensor, num_slots: int) -> PairGroups:
    """Sort (token, j) pairs by j·S + slot; return sorted tokens, weights, segment starts/counts."""
    T, K = slot_ids.shape
    S = num_slots
    flat = slot_ids.reshape(-1).long()
    j = torch.arange(K, device=flat.device).repeat(T)
    key = torch.where(flat > 0, j * S + flat, torch.full_like(flat, K * S))
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(K * S + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[: K * S]
    starts = torch.cumsum(counts, 0) - counts
    tokens = (order // K).to(torch.int32)
    sorted_w = weights.reshape(-1)[order].float().contiguous()
    return tokens, sorted_w, starts.to(torch.int32), counts.to(torch.int32)


@dataclass
class DevicePlan:
    """One routing table as the kernels read it; SGMV segments built on first use per slot count."""

    slot_ids: torch.Tensor  # [T, K] int32, contiguous
    weights: torch.Tensor  # [T, K], contiguous
    _groups: dict[int, PairGroups] = field(default_factory=dict)

    def groups(self, num_slots: int) -> PairGroups:
        cached = self._groups.get(num_slots)
        if cached is None:
            cached = group_pairs(self.slot_ids, self.weights, num_slots)
            self._groups[num_slots] = cached
        return cached


def build_device_plan(slot_ids: torch.Tensor, weights: torch.Tensor) -> DevicePlan:
    return DevicePlan(slot_ids.to(torch.int32).contiguous(), weights.contiguous())
