"""Per-request gate summaries, folded on the device and read once when the request finishes.

A request on a learned route that asks for one gets a row of a `[rows, L, F]` accumulator
while it runs. After every forward, `record` takes the rows that produced a generated token
(the same rows attribution reads) out of the step's per-layer tables and gate logits, turns
them into per-layer counts and sums, and `index_add_`s them into the requests' rows: device
ops only, with the row indexes copied from pinned memory without blocking, so no step waits on
the host. `take` reads a finished request's row back (one read per request) and frees it.

Only generated tokens count: the routing of the row that produced each generated token. Prompt
positions are left out, since which of them a request computes depends on the prefix cache
and on n > 1 siblings sharing one prefill, not on the request.

Columns of a layer, for K the hot-set's most experts per composition: top-k selections per
expert [K], mixture weight sums per expert [K], top-1 (first-ranked) counts per expert [K],
normalized entropy sum, token count.
"""

from __future__ import annotations

import math

import torch

from molora_runtime.engine.sequence import Sequence
from molora_runtime.engine.types import GateSummary
from molora_runtime.lora.hotset import HotSet
from molora_runtime.model.lora_context import LoRAContext


def wants_summary(seq: Sequence) -> bool:
    return seq.request.return_gate_summary and seq.route.is_learned


class GateSummaries:
    """Rows of a device accumulator, one per running request that asked for a summary."""

    def __init__(self, hot_set: HotSet, rows: int) -> None:
        self.hot_set = hot_set
        self._initial_rows = max(1, rows)
        self._acc: torch.Tensor | None = None
        self._row: dict[str, int] = {}  # request id -> accumulator row
        self._experts: dict[str, list[str]] = {}  # request id -> its composition's experts
        self._free: list[int] = []

    def record(self, ctx: LoRAContext | None, seqs: list[Sequence], rows: list[int]) -> None:
        """Fold the routing of batch rows `rows` into the rows of `seqs` (same order), for
        those that asked for a summary."""
        picked = [(s, r) for s, r in zip(seqs, rows, strict=True) if wants_summary(s)]
        if not picked or ctx is None or not ctx.has_learned or not ctx.layer_logits:
            return
        assert ctx.comp_idx is not None and ctx.gates is not None
        dev = ctx.comp_idx.device
        index = _device_index([r for _, r in picked], dev)
        target = _device_index([self._row_of(s) for s, _ in picked], dev)
        assert self._acc is not None  # the gate table's shape is fixed: so is every row's
        self._acc.index_add_(0, target, self._fold(ctx, index))

    def _fold(self, ctx: LoRAContext, index: torch.Tensor) -> torch.Tensor:
        assert ctx.comp_idx is not None and ctx.gates is not None
        g = ctx.gates
        K = g.expert_slots.shape[1]
        all_slots, all_weights = ctx.recorded_tables()  # [L, T, W]
        slots = all_slots.index_select(1, index)  # [L, R, W]
        weights = all_weights.index_select(1, index).float()
        comp = ctx.comp_idx.index_select(0, index).clamp(min=0)  # [R]
        experts = g.expert_slots.index_select(0, comp)  # [R, K]
        n = g.num_experts.index_select(0, comp)  # [R]
        real = torch.arange(K, device=n.device)[None, :] < n[:, None]  # [R, K]
        hit = slots[..., None] == experts[None, :, None, :]  # [L, R, W, K]
        hit = hit & (weights > 0)[..., None] & real[None, :, None, :]
        selected = hit.sum(2, dtype=torch.float64)  # [L, R, K]
        weight_sum = (hit * weights[..., None]).sum(2, dtype=torch.float64)
        logits = ctx.recorded_logits().index_select(1, index).float()
        if logits.shape[-1] < K:  # the one-composition path keeps only its real experts
            logits = torch.nn.functional.pad(logits, (0, K - logits.shape[-1]), value=-math.inf)
        logits = logits[..., :K].masked_fill(~real[None], -math.inf)
        logp = torch.log_softmax(logits, dim=-1)
        entropy = -(logp.exp() * logp).nan_to_num(0.0).sum(-1)  # [L, R]
        scale = torch.where(n > 1, n.clamp(min=2).double().log(), torch.inf)
        entropy = entropy.double() / scale[None, :]
        first = torch.nn.functional.one_hot(logits.argmax(-1), K).to(torch.float64)
        ones = torch.ones_like(entropy)
        cols = [selected, weight_sum, first, entropy[..., None], ones[..., None]]
        return torch.cat(cols, dim=-1).transpose(0, 1).contiguous()  # [R, L, F]

    def _row_of(self, seq: Sequence) -> int:
        rid = seq.request_id
        row = self._row.get(rid)
        if row is not None:
            return row
        if not self._free:
            self._grow()
        row = self._free.pop()
        self._row[rid] = row
        self._experts[rid] = list(self.hot_set.composition_info(seq.composition or "").experts)
        assert self._acc is not None
        self._acc[row].zero_()
        return row

    def _grow(self) -> None:
        """Room for more rows (the first call allocates): doubles, on the gates' device."""
        g = self.hot_set.gates
        L, K = g.weight.shape[1], g.weight.shape[2]
        old = self._acc
        have = 0 if old is None else old.shape[0]
        extra = self._initial_rows if old is None else have
        new = torch.zeros(extra, L, 3 * K + 2, dtype=torch.float64, device=g.weight.device)
        self._acc = new if old is None else torch.cat([old, new])
        self._free.extend(range(have + extra - 1, have - 1, -1))

    def take(self, seq: Sequence) -> GateSummary | None:
        """The finished request's summary (one device read), its row freed; None when it has
        none (nothing generated, or not asked)."""
        rid = seq.request_id
        row = self._row.get(rid)
        if row is None or self._acc is None:
            return None
        experts = self._experts[rid]
        data = self._acc[row].cpu()
        self.drop(rid)
        layers = seq.request.gate_summary_layers
        return summarize(data, seq.composition or "", experts, layers)

    def drop(self, request_id: str) -> None:
        """Free a request's row without reading it (abort, error)."""
        row = self._row.pop(request_id, None)
        self._experts.pop(request_id, None)
        if row is not None:
            self._free.append(row)

    @property
    def active(self) -> int:
        return len(self._row)


def summarize(
    data: torch.Tensor, composition: str, experts: list[str], layers: bool
) -> GateSummary:
    """The summary of one accumulator row `[L, F]` over the composition's `experts`."""
    L, F = data.shape
    K, n = (F - 2) // 3, len(experts)
    tokens = round(float(data[0, -1]))
    selected = data[:, :n].sum(0)
    total = float(selected.sum())
    per_layer = max(tokens, 1) * L
    first = data[:, 2 * K : 2 * K + n]
    return GateSummary(
        composition=composition,
        experts=experts,
        tokens=tokens,
        layers=L,
        share=[_r(v / total) if total else 0.0 for v in selected.tolist()],
        mean_weight=[_r(v / per_layer) for v in data[:, K : K + n].sum(0).tolist()],
        mean_entropy=_r(float(data[:, 3 * K].sum()) / per_layer),
        layer_top1_share=[[_r(v / max(tokens, 1)) for v in row] for row in first.tolist()]
        if layers
        else None,
    )


def _r(value: float) -> float:
    return round(value, 6)


def _device_index(values: list[int], device: torch.device) -> torch.Tensor:
    """A long index on `device`; on CUDA copied from pinned memory without a host wait."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
