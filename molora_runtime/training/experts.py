"""Frozen expert adapters and trainable gates on the serving model (`molora_runtime.model`).

Router training runs the same decoder, routed-LoRA op and gate code (`LoRAContext`) that the
engine serves with; this module only fills the slot buffers `A[S, L, r, d_in]`, `B[S, L, d_out, r]`
(slot 0 = no adapter, slot i = expert i) and builds the per-forward context, the way the hot-set
does for a served composition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from molora_runtime.lora.peft_adapter import AdapterWeights
from molora_runtime.model.decoder import CausalLM
from molora_runtime.model.lora_backend import LoRABackend, ReferenceBackend, TritonBackend
from molora_runtime.model.lora_context import GateTable, LoRAContext
from molora_runtime.model.slot_buffers import GroupBuffers, LoRABuffers


def attach_experts(lm: CausalLM, experts: list[AdapterWeights]) -> None:
    """Copy the experts into fresh slot buffers (rank zero-padded) and attach them to `lm`."""
    arch = lm.arch
    device = lm.embed_tokens.weight.device
    dtype = lm.embed_tokens.weight.dtype
    rank = max(e.rank for e in experts)
    modules = sorted({m for e in experts for m in e.modules})
    buffers: dict[str, LoRABuffers] = {}
    for module in modules:
        d_in, d_out = arch.linear_shape(module)
        S, L = len(experts) + 1, arch.num_layers
        A = torch.zeros(S, L, rank, d_in, dtype=dtype, device=device)
        B = torch.zeros(S, L, d_out, rank, dtype=dtype, device=device)
        for slot, expert in enumerate(experts, start=1):
            for layer, (a, b) in expert.modules.get(module, {}).items():
                A[slot, layer, : a.shape[0]] = a.to(device, dtype)
                B[slot, layer, :, : b.shape[1]] = b.to(device, dtype)
        buffers[module] = LoRABuffers(A, B)
    used = {(m, layer) for e in experts for m, layers in e.modules.items() for layer in layers}
    for linear in lm.lora_linears():
        # A projection no expert adapts keeps no buffers: its output is exact without the op,
        # and backward then never runs through layers below the lowest adapted one.
        adapted = (linear.name, linear.layer) in used
        linear.lora = buffers.get(linear.name) if adapted else None
    for fused in lm.fused_groups():
        members = [m.lora for m in fused.members]
        fused.lora = GroupBuffers(members, fused.splits) if any(members) else None


def training_backend(device: torch.device) -> LoRABackend:
    """The Triton kernels on CUDA (the reference twin whenever autograd needs it), else the twin."""
    return TritonBackend() if device.type == "cuda" else ReferenceBackend()


class TrainableGates(Protocol):
    """What router training needs of a composition's gates: the [L, K, d] / [L, K] tensors the
    forward reads, the tensors the optimizer steps, and the engine's gate table."""

    @property
    def weight(self) -> torch.Tensor: ...

    @property
    def bias(self) -> torch.Tensor: ...

    def params(self) -> dict[str, torch.nn.Parameter]: ...

    def table(self) -> GateTable: ...


@dataclass
class Gates:
    """One composition's per-layer linear gates d→K (the tensors saved in gates.safetensors)."""

    weight: torch.nn.Parameter  # [L, K, d]
    bias: torch.nn.Parameter  # [L, K]

    @classmethod
    def init(cls, num_layers: int, k: int, d: int, seed: int, device=None) -> Gates:
        """Small random weights (ties broken), zero bias: the start is a near-uniform mix."""
        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(num_layers, k, d, generator=gen) * (0.01 / d**0.5)
        return cls(
            weight=torch.nn.Parameter(w.to(device)),
            bias=torch.nn.Parameter(torch.zeros(num_layers, k, device=device)),
        )

    def params(self) -> dict[str, torch.nn.Parameter]:
        return {"gate.weight": self.weight, "gate.bias": self.bias}

    def table(self) -> GateTable:
        K = self.weight.shape[1]
        device = self.weight.device
        return GateTable(
            weight=self.weight.unsqueeze(0),
            bias=self.bias.unsqueeze(0),
            expert_slots=torch.arange(1, K + 1, device=device).unsqueeze(0),
            num_experts=torch.tensor([K], device=device),
        )


def learned_context(
    gates: TrainableGates,
    num_tokens: int,
    top_k: int,
    temperature: float = 1.0,
    record_layers: bool = False,
    return_gate_logits: bool = False,
) -> LoRAContext:
    """Every token on the learned route of composition slot 0 (as the engine builds it)."""
    K = gates.weight.shape[1]
    device = gates.weight.device
    return LoRAContext(
        slot_ids=torch.zeros(num_tokens, K, dtype=torch.long, device=device),
        weights=torch.zeros(num_tokens, K, dtype=torch.float32, device=device),
        backend=training_backend(device),
        comp_idx=torch.zeros(num_tokens, dtype=torch.long, device=device),
        gates=gates.table(),
        top_k=torch.full((num_tokens,), top_k, dtype=torch.long, device=device),
        temperature=torch.full((num_tokens,), temperature, dtype=torch.float32, device=device),
        record_layers=record_layers,
        return_gate_logits=return_gate_logits,
    )


def static_context(slots: torch.Tensor) -> LoRAContext:
    """Per-token single-adapter route: token t uses slot `slots[t]` (0 = base) with weight 1."""
    return LoRAContext(
        slot_ids=slots.long().unsqueeze(1),
        weights=(slots > 0).float().unsqueeze(1),
        backend=training_backend(slots.device),
    )
