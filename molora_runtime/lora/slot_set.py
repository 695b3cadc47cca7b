"""The slot buffers of every LoRA target module, allocated for the engine's backend and attached
to the model's layers; the one place adapter weights are written into a slot."""

from __future__ import annotations

import torch

from molora_runtime.config import HotSetConfig
from molora_runtime.errors import AdapterLoadError
from molora_runtime.lora.peft_adapter import AdapterWeights
from molora_runtime.model.arch import ModelArch
from molora_runtime.model.decoder import CausalLM
from molora_runtime.model.slot_buffers import GroupBuffers, LoRABuffers, SlotValueError


class SlotBufferSet:
    """Per target module `LoRABuffers` (slot 0 stays all-zero: "no adapter"), and per fused group
    (q/k/v, gate/up) the `GroupBuffers` its layer calls the backend with."""

    def __init__(
        self,
        model: CausalLM,
        config: HotSetConfig,
        stacked: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        arch: ModelArch = model.arch
        S, L, r = config.num_slots + 1, arch.num_layers, config.max_rank
        targets = set(config.target_modules)
        self.buffers: dict[str, LoRABuffers] = {}
        self.groups: dict[tuple[str, ...], GroupBuffers] = {}
        for fused in model.fused_groups():
            names = fused.names
            if names in self.groups or not targets.intersection(names):
                continue
            shapes = [arch.linear_shape(n) for n in names]
            widths = [d_out for _, d_out in shapes]
            hit = [n in targets for n in names]
            if stacked:  # one shared A: one shrink for the whole group
                group = GroupBuffers.stacked_group(
                    S, L, r, shapes[0][0], widths, hit, dtype, device
                )
            else:
                members = [
                    LoRABuffers.allocate(S, L, r, d_in, d_out, dtype, device, stacked=False)
                    if t else None
                    for (d_in, d_out), t in zip(shapes, hit, strict=True)
                ]  # fmt: skip
                group = GroupBuffers(members, widths)
            self.groups[names] = group
            for name, member in zip(names, group.members, strict=True):
                if member is not None:
                    self.buffers[name] = member
        for module in config.target_modules:
            if module not in self.buffers:
                d_in, d_out = arch.linear_shape(module)
                self.buffers[module] = LoRABuffers.allocate(
                    S, L, r, d_in, d_out, dtype, device, stacked=stacked
                )
        for linear in model.lora_linears():
            linear.lora = self.buffers.get(linear.name)
        for fused in model.fused_groups():
            fused.lora = self.groups.get(fused.names)
        self.total_slots = S  # incl. the zero slot

    def probe(self) -> GroupBuffers | LoRABuffers:
        """The buffers a start-up timing runs on: the first fused group, else any module."""
        return next(iter(self.groups.values()), None) or next(iter(self.buffers.values()))

    def slot_nbytes(self) -> int:
        """Device bytes of one slot (every target module, every layer, at max rank)."""
        grouped = {n for names in self.groups for n in names}
        total = sum(g.nbytes for g in self.groups.values()) + sum(
            b.nbytes for n, b in self.buffers.items() if n not in grouped
        )
        return total // self.total_slots

    def write(self, slot: int, weights: AdapterWeights) -> None:
        """Replace `slot`'s contents with `weights`; on a value out of bounds the slot is left
        all-zero and the load fails with the reason."""
        with torch.no_grad():
            try:
                for module, buf in self.buffers.items():
                    buf.clear_slot(slot)
                    for layer, (a, b) in weights.modules.get(module, {}).items():
                        buf.write(slot, layer, a, b)
            except SlotValueError as exc:
                self.clear(slot)
                raise AdapterLoadError(f"adapter {weights.name!r}: {module} {exc}") from None

    def clear(self, slot: int) -> None:
        with torch.no_grad():
            for buf in self.buffers.values():
                buf.clear_slot(slot)
