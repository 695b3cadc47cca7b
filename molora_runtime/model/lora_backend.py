"""The LoRA backend: how every LoRA-targeted projection adds its routed delta, chosen once.

Each layer makes one call, `backend.add(y, x, buffers, layer, ctx)`, over its slot buffers (a
projection's `LoRABuffers` or a fused group's `GroupBuffers`; a lone projection reads as a group
of one member), adding `Σ_j w[t, j] · B[s] A[s] x[t]` into its output `y` in place. The engine
picks one backend at start (`choose_backend`):

- CUDA: the Triton kernels (BGMV for decode, SGMV for prefill; one launch per group of up to
  three outputs), over the kernel layout.
- CPU: one of the stacked-layout backends of `cpu_lora` (stacked, stacked-packed, grouped),
  picked by timing them on this engine's own buffers (`cpu_lora_choice`), never by the CPU's
  model name.
- anything else, and every call that must backpropagate (router training): the reference twin
  `routed_lora_segmented`, which reads only the rows that use each slot.
"""

from __future__ import annotations

import torch

from kernels.reference import routed_lora_segmented
from molora_runtime.model import cpu_lora_choice
from molora_runtime.model.cpu_lora import CpuLoRA, SlotBuffers, needs_grad
from molora_runtime.model.lora_context import LoRAContext


class ReferenceBackend:
    """Kernel layout, the reference twin per targeted member: differentiable, any device."""

    name = "reference"
    stacked = False

    def add(
        self, y: torch.Tensor, x: torch.Tensor, buffers: SlotBuffers, layer: int, ctx: LoRAContext
    ) -> torch.Tensor:
        for buf, col in buffers.columns:
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
        members = buffers.columns
        pairs = [buf.kernel_pair(layer) for buf, _ in members]
        if needs_grad(x, ctx.weights, *(t for pair in pairs for t in pair)):
            return super().add(y, x, buffers, layer, ctx)
        # triton: the optional `kernels` extra, imported only on the path that runs it
        from kernels.triton_ops import routed_lora_multi_triton

        deltas = routed_lora_multi_triton(
            x, pairs, ctx.slot_ids, ctx.weights, plan=ctx.kernel_meta()
        )
        for (_, col), delta in zip(members, deltas, strict=True):
            y = _add_columns(y, delta.to(y.dtype), col)
        return y


LoRABackend = ReferenceBackend | CpuLoRA


def _add_columns(y: torch.Tensor, delta: torch.Tensor, col: int) -> torch.Tensor:
    """`y` with `delta` added to its columns from `col` on (in place unless autograd needs not)."""
    if col == 0 and delta.shape[1] == y.shape[1]:
        return y + delta if needs_grad(y, delta) else y.add_(delta)
    if needs_grad(y, delta):
        y = y.clone()
    y[:, col : col + delta.shape[1]] += delta
    return y


def choose_backend(device: torch.device, probe: SlotBuffers | None = None) -> LoRABackend:
    """The backend this engine serves with: by device, and on CPU the one `cpu_lora_choice`
    picks for `probe` (a fused group's or a projection's stacked buffers)."""
    if device.type == "cuda":
        return TritonBackend()
    if device.type != "cpu":
        return ReferenceBackend()
    return cpu_lora_choice.choose(probe)
