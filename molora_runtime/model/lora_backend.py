"""The LoRA backend: how every LoRA-targeted projection adds its routed delta, chosen once.

Each layer makes one call, `backend.add(y, x, buffers, layer, ctx)`, over its slot buffers (a
projection's `LoRABuffers` or a fused group's `GroupBuffers`), adding
`Σ_j w[t, j] · B[s] A[s] x[t]` into its output `y` in place. The engine picks one backend at
start (`choose_backend`):

- CUDA: the Triton kernels (BGMV for decode, SGMV for prefill; one launch per group of up to
  three outputs), over the kernel layout.
- CPU: the stacked two-GEMM delta (`kernels.stacked`), its GEMMs either plain or on packed copies
  of the slot range (`pack_weight`), or the grouped kernel (`kernels.cpu_topk_delta`, one call
  per projection reading only each token's own slots) for every table; which of the three is
  decided by timing them on this engine's own buffers at start, never by the CPU's model name.
  Steps whose table a learned gate wrote (top-k over a composition) run the grouped kernel
  wherever it runs here.
- anything else, and every call that must backpropagate (router training): the reference twin
  `routed_lora_segmented`, which reads only the rows that use each slot.

A token never reads a slot it does not use: the stacked path selects (never multiplies by 0),
the others only visit each token's own slots.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from kernels import cpu_topk_delta
from kernels.cpu_topk_delta import GroupedDelta
from kernels.reference import routed_lora_segmented
from kernels.stacked import SlotGate, routed_lora_stacked, routed_lora_stacked_group
from molora_runtime.model.lora_context import LoRAContext
from molora_runtime.model.packed_linear import PackedPairs, PackedWeight, pack_weight, packed_gemm
from molora_runtime.model.slot_buffers import GroupBuffers, LoRABuffers

log = logging.getLogger(__name__)

SlotBuffers = LoRABuffers | GroupBuffers


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class ReferenceBackend:
    """Kernel layout, the reference twin per targeted member: differentiable, any device."""

    name = "reference"
    stacked = False

    def add(
        self, y: torch.Tensor, x: torch.Tensor, buffers: SlotBuffers, layer: int, ctx: LoRAContext
    ) -> torch.Tensor:
        for buf, col in _members(buffers):
            A, B = buf.kernel_pair(layer)
            delta = routed_lora_segmented(x, A, B, ctx.slot_ids, ctx.weights).to(y.dtype)
            y = _add_columns(y, delta, col)
        return y


class TritonBackend(ReferenceBackend):
    """Kernel layout, the Triton kernels on CUDA (the reference twin under autograd)."""

    name = "triton"

    def add(
        self, y: torch.Tensor, x: torch.Tensor, buffers: SlotBuffers, layer: int, ctx: LoRAContext
    ) -> torch.Tensor:
        members = _members(buffers)
        pairs = [buf.kernel_pair(layer) for buf, _ in members]
        if _needs_grad(x, ctx.weights, *(t for pair in pairs for t in pair)):
            return super().add(y, x, buffers, layer, ctx)
        # triton: the optional `kernels` extra, imported only on the path that runs it
        from kernels.triton_ops import routed_lora_multi_triton

        deltas = routed_lora_multi_triton(
            x, pairs, ctx.slot_ids, ctx.weights, plan=ctx.kernel_meta()
        )
        for (_, col), delta in zip(members, deltas, strict=True):
            y = _add_columns(y, delta.to(y.dtype), col)
        return y


class StackedBackend:
    """Stacked layout (CPU): one shrink and one expand per projection or fused group, over the
    slot range this step touches; `packed` runs both on packed copies of that range. With
    `grouped`, a learned gate's table runs the grouped top-k kernel over the same buffers, and
    with `grouped_static` every other table too."""

    stacked = True

    def __init__(self, packed: bool, grouped: bool = False, grouped_static: bool = False) -> None:
        self.packed, self.grouped = packed, grouped
        self.grouped_static = grouped and grouped_static
        self.name = "grouped" if self.grouped_static else "stacked-packed" if packed else "stacked"
        self._pairs: dict[int, PackedPairs] = {}  # per buffers object
        # per (buffers object, layer): the buffers (kept, so their id is not reused) and the call
        self._deltas: dict[tuple[int, int], tuple[SlotBuffers, GroupedDelta]] = {}

    def add(
        self, y: torch.Tensor, x: torch.Tensor, buffers: SlotBuffers, layer: int, ctx: LoRAContext
    ) -> torch.Tensor:
        if ctx.stacked_slots is None:  # no token of this step uses an adapter
            return y
        learned = self.grouped_static or ctx.learned_routes
        if self.grouped and learned and not _needs_grad(x, ctx.weights):
            return self._grouped_delta(buffers, layer)(y, x, ctx.slot_ids, ctx.weights)
        first, count = ctx.stacked_slots
        gate = ctx.slot_gate(buffers.rank, buffers.A.dtype)
        if self.packed and not _needs_grad(x, gate.weights):
            pair = self._packed_pair(buffers, layer, first, count)
            if pair is not None:
                return _packed_delta(x, pair[0], pair[1], gate, y)
        if isinstance(buffers, GroupBuffers):
            A, member_bt = buffers.slot_views(layer, first, count)
            return routed_lora_stacked_group(x, A, member_bt, buffers.member_rank, gate, y)
        a_flat, bt_flat = buffers.stacked_pair(layer, first, count)
        return routed_lora_stacked(x, a_flat, bt_flat, gate, out=y)

    def _grouped_delta(self, buffers: SlotBuffers, layer: int) -> GroupedDelta:
        """The grouped kernel's call over one layer's slot rows of `buffers`, made once."""
        key = (id(buffers), layer)
        cached = self._deltas.get(key)
        if cached is None:
            if isinstance(buffers, GroupBuffers):
                assert buffers.A is not None
                members = [(m.B[layer], col) for m, col in buffers.columns]
                delta = GroupedDelta(buffers.A[layer], members, buffers.slot_base)
            else:
                delta = GroupedDelta(buffers.A[layer], [(buffers.B[layer], 0)], buffers.slot_base)
            cached = self._deltas[key] = (buffers, delta)
        return cached[1]

    def _packed_pair(
        self, buffers: SlotBuffers, layer: int, first: int, count: int
    ) -> tuple[PackedWeight, PackedWeight] | None:
        cache = self._pairs.get(id(buffers))
        if cache is None:
            cache = self._pairs[id(buffers)] = PackedPairs()
        if isinstance(buffers, GroupBuffers):
            assert buffers.A is not None and buffers.Bt is not None
            return cache.get(
                buffers.A, buffers.Bt, (layer, first, count),
                lambda: buffers.block_pair(layer, first, count),
            )  # fmt: skip
        return cache.get(
            buffers.A, buffers.B, (layer, first, count),
            lambda: buffers.stacked_pair(layer, first, count),
        )  # fmt: skip


LoRABackend = ReferenceBackend | StackedBackend


def _members(buffers: SlotBuffers) -> list[tuple[LoRABuffers, int]]:
    """Targeted members and their first output column (a lone projection: itself at 0)."""
    return buffers.columns if isinstance(buffers, GroupBuffers) else [(buffers, 0)]


def _add_columns(y: torch.Tensor, delta: torch.Tensor, col: int) -> torch.Tensor:
    """`y` with `delta` added to its columns from `col` on (in place unless autograd needs not)."""
    if col == 0 and delta.shape[1] == y.shape[1]:
        return y + delta if _needs_grad(y, delta) else y.add_(delta)
    if _needs_grad(y, delta):
        y = y.clone()
    y[:, col : col + delta.shape[1]] += delta
    return y


def _packed_delta(
    x: torch.Tensor, A: PackedWeight, Bt: PackedWeight, gate: SlotGate, out: torch.Tensor
) -> torch.Tensor:
    """`routed_lora_stacked` (its twin) on packed copies of the slot range."""
    h = packed_gemm(x, A)
    h.mul_(gate.weights.to(h.dtype)).masked_fill_(gate.inactive, 0.0)
    return out.add_(packed_gemm(h, Bt))


def choose_backend(device: torch.device, probe: SlotBuffers | None = None) -> LoRABackend:
    """The backend this engine serves with: by device, and on CPU by timing both stacked
    candidates on `probe` (a fused group's or a projection's stacked buffers)."""
    if device.type == "cuda":
        return TritonBackend()
    if device.type != "cpu":
        return ReferenceBackend()
    grouped = cpu_topk_delta.available()
    plain, packed = StackedBackend(False, grouped), StackedBackend(True, grouped)
    if probe is None:
        return plain
    candidates = [plain] if pack_weight(probe.A[0, 0]) is None else [plain, packed]
    if grouped:
        candidates.append(StackedBackend(False, grouped, grouped_static=True))
    if len(candidates) == 1:
        return plain
    times = _time_candidates(candidates, probe)
    best = min(times, key=times.__getitem__)
    log.info(
        "LoRA backend: %s (start-up timing, ms per call: %s); learned top-k steps: %s",
        best.name, ", ".join(f"{b.name} {t * 1e3:.3f}" for b, t in times.items()),
        "the grouped kernel" if grouped else "the stacked path",
    )  # fmt: skip
    return best


def _time_candidates(
    candidates: list[StackedBackend], probe: SlotBuffers, tokens: tuple[int, ...] = (8, 32)
) -> dict[StackedBackend, float]:
    """Median seconds of layer 0's delta, summed over batches of `tokens` tokens spread over
    every slot and one of the largest batch on one slot, candidates interleaved round by round
    so a busy neighbour slows all alike."""
    slots = probe.A.shape[1] - 1 + probe.slot_base  # slot ids 1..slots (row 0 may be the zero slot)
    d_in = probe.A.shape[-1]
    dtype = probe.A.dtype
    width = probe.width
    gen = torch.Generator().manual_seed(0)
    cases = []
    tables = [(T, torch.arange(T) % slots + 1, (1, slots)) for T in tokens]
    tables.append((max(tokens), torch.ones(max(tokens), dtype=torch.long), (1, 1)))
    for T, ids, stacked in tables:
        x = torch.randn(T, d_in, generator=gen).to(dtype)
        ctx = LoRAContext(ids.view(T, 1), torch.ones(T, 1), backend=None, stacked_slots=stacked)
        cases.append((x, ctx))
    samples: dict[StackedBackend, list[float]] = {b: [] for b in candidates}
    with torch.inference_mode():
        for _ in range(7):
            for backend in candidates:
                start = time.perf_counter()
                for x, ctx in cases:
                    backend.add(torch.zeros(x.shape[0], width, dtype=dtype), x, probe, 0, ctx)
                samples[backend].append(time.perf_counter() - start)
    return {b: statistics.median(s[2:]) for b, s in samples.items()}
