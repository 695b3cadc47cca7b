"""The CPU LoRA backends: one class per kernel the start-up choice can pick, all over the stacked
slot layout (`slot_buffers`: one layer's slots are one `[S·r, d]` matrix, a fused group shares
one `A`).

- `StackedLoRA`: two GEMMs per projection or fused group over the step's slot range
  (`kernels.stacked`; each kind of slot buffers runs its own form, `stacked_delta`);
- `PackedLoRA`: the same two GEMMs on packed copies of that range (`packed_linear.pack_weight`:
  panels or oneDNN's), built on first use and dropped when the slots change;
- `GroupedLoRA`: the grouped top-k kernel (`kernels.cpu_topk_delta`), which reads only each
  token's own slots, for every table.

Which one serves is decided once per engine by timing them (`cpu_lora_choice`); none of them
branches on the buffers' layout per call. Where the grouped kernel runs, `StackedLoRA` and
`PackedLoRA` also hand it the tables a learned gate wrote (top-k over a composition: S/k times
less work than the stacked range). A token never reads a slot it does not use: the stacked
delta selects (never multiplies by 0), the grouped kernel only visits each token's own slots.
Under autograd (never while serving) every class runs the stacked delta, which backpropagates.
"""

from __future__ import annotations

import torch

from kernels.cpu_topk_delta import GroupedDelta
from kernels.stacked import SlotGate
from molora_runtime.model.lora_context import LoRAContext
from molora_runtime.model.packed_linear import PackedPairs, PackedWeight, packed_gemm
from molora_runtime.model.slot_buffers import GroupBuffers, LoRABuffers

SlotBuffers = LoRABuffers | GroupBuffers


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd must see through an op on `tensors` (router training, never serving)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class GroupedDeltas:
    """The grouped kernel's call over each layer of each slot buffers, made once (its checks
    and the slot rows' addresses are read at construction, not per call)."""

    def __init__(self) -> None:
        # per (buffers object, layer): the buffers (kept, so their id is not reused) and the call
        self._deltas: dict[tuple[int, int], tuple[SlotBuffers, GroupedDelta]] = {}

    def add(
        self, y: torch.Tensor, x: torch.Tensor, buffers: SlotBuffers, layer: int, ctx: LoRAContext
    ) -> torch.Tensor:
        """`y` plus the delta of `x` over each token's own slots of `ctx`'s table."""
        key = (id(buffers), layer)
        cached = self._deltas.get(key)
        if cached is None:
            A, members = buffers.slot_rows(layer)
            cached = self._deltas[key] = (buffers, GroupedDelta(A, members, buffers.slot_base))
        return cached[1](y, x, ctx.slot_ids, ctx.weights)


class StackedLoRA:
    """Two GEMMs per projection or fused group over the step's slot range; `grouped` (the
    grouped kernel's calls, where it runs) takes the tables a learned gate wrote."""

    name = "stacked"
    stacked = True  # reads the stacked slot layout

    def __init__(self, grouped: GroupedDeltas | None = None) -> None:
        self.grouped = grouped

    def add(
        self, y: torch.Tensor, x: torch.Tensor, buffers: SlotBuffers, layer: int, ctx: LoRAContext
    ) -> torch.Tensor:
        """`y` plus the routed delta of `x` over `buffers`' slots of layer `layer`."""
        if ctx.stacked_slots is None:  # no token of this step uses an adapter
            return y
        if self.grouped is not None and ctx.learned_routes and not needs_grad(x, ctx.weights):
            return self.grouped.add(y, x, buffers, layer, ctx)
        return self.delta(y, x, buffers, layer, ctx)

    def delta(
        self, y: torch.Tensor, x: torch.Tensor, buffers: SlotBuffers, layer: int, ctx: LoRAContext
    ) -> torch.Tensor:
        """The stacked delta over the step's slot range, added into `y`."""
        assert ctx.stacked_slots is not None
        first, count = ctx.stacked_slots
        gate = ctx.slot_gate(buffers.rank, buffers.A.dtype)
        return buffers.stacked_delta(y, x, layer, first, count, gate)


class PackedLoRA(StackedLoRA):
    """`StackedLoRA`'s two GEMMs on packed copies of the slot range (`PackedPairs`): a LoRA
    GEMM at decode sizes is per-call set-up, which a packed weight makes cheaper."""

    name = "stacked-packed"

    def __init__(self, grouped: GroupedDeltas | None = None) -> None:
        super().__init__(grouped)
        self._pairs: dict[int, tuple[SlotBuffers, PackedPairs]] = {}  # per buffers object

    def delta(
        self, y: torch.Tensor, x: torch.Tensor, buffers: SlotBuffers, layer: int, ctx: LoRAContext
    ) -> torch.Tensor:
        assert ctx.stacked_slots is not None
        first, count = ctx.stacked_slots
        gate = ctx.slot_gate(buffers.rank, buffers.A.dtype)
        pair = None if needs_grad(x, gate.weights) else self._pair(buffers, layer, first, count)
        if pair is None:  # autograd, or a range neither packing takes: the plain GEMMs
            return super().delta(y, x, buffers, layer, ctx)
        return _packed_delta(x, pair[0], pair[1], gate, y)

    def _pair(
        self, buffers: SlotBuffers, layer: int, first: int, count: int
    ) -> tuple[PackedWeight, PackedWeight] | None:
        cached = self._pairs.get(id(buffers))
        if cached is None:
            cached = self._pairs[id(buffers)] = (buffers, PackedPairs())
        return cached[1].get(
            buffers.A, buffers.Bt, (layer, first, count),
            lambda: buffers.block_pair(layer, first, count),
        )  # fmt: skip


class GroupedLoRA(StackedLoRA):
    """The grouped top-k kernel over each token's own slots, for every table."""

    name = "grouped"

    def __init__(self, grouped: GroupedDeltas) -> None:
        super().__init__(grouped)
        self.kernel = grouped  # never None here

    def add(
        self, y: torch.Tensor, x: torch.Tensor, buffers: SlotBuffers, layer: int, ctx: LoRAContext
    ) -> torch.Tensor:
        if ctx.stacked_slots is None:  # no token of this step uses an adapter
            return y
        if needs_grad(x, ctx.weights):
            return self.delta(y, x, buffers, layer, ctx)
        return self.kernel.add(y, x, buffers, layer, ctx)


CpuLoRA = StackedLoRA | PackedLoRA | GroupedLoRA


def _packed_delta(
    x: torch.Tensor, A: PackedWeight, Bt: PackedWeight, gate: SlotGate, out: torch.Tensor
) -> torch.Tensor:
    """The stacked delta (`kernels.stacked`, its twin) on packed copies of the slot range, its
    expand one GEMM over the members' block-structured `Bt`."""
    h = packed_gemm(x, A)
    h.mul_(gate.weights.to(h.dtype)).masked_fill_(gate.inactive, 0.0)
    return out.add_(packed_gemm(h, Bt))
