"""The composition gate table: learned compositions' per-layer gates in static device tensors.

A learned route's gates live in one of `max_compositions` gate slots (`GateTable`, read by the
model during a forward); a composition held by a running request is never evicted, the others
go least recently used first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from molora_runtime.errors import AdapterLoadError, HotSetFullError
from molora_runtime.lora.composition import Composition, CompositionError, load_composition
from molora_runtime.lora.pinned_lru import PinnedLRU
from molora_runtime.lora.source import AdapterSource
from molora_runtime.model.arch import ModelArch
from molora_runtime.model.lora_context import GateTable


@dataclass
class CompositionInfo:
    """What a resident composition routes to, and how."""

    name: str
    experts: list[str] = field(default_factory=list)
    top_k: int = 1
    temperature: float = 1.0


class GateSlots:
    """Owns the gate tensors and which composition sits in which gate slot."""

    def __init__(
        self,
        arch: ModelArch,
        slots: int,
        max_experts: int,
        max_adapter_slots: int,
        device: torch.device,
    ) -> None:
        self.arch = arch
        self.capacity = slots
        self.max_experts = max_experts
        self.max_adapter_slots = max_adapter_slots
        C, K, L, d = max(1, slots), max_experts, arch.num_layers, arch.hidden_size
        self.table = GateTable(
            weight=torch.zeros(C, L, K, d, dtype=torch.float32, device=device),
            bias=torch.zeros(C, L, K, dtype=torch.float32, device=device),
            expert_slots=torch.zeros(C, K, dtype=torch.long, device=device),
            num_experts=torch.ones(C, dtype=torch.long, device=device),
        )
        self._lru: PinnedLRU[str, int] = PinnedLRU()  # name -> gate slot
        self._info: dict[int, CompositionInfo] = {}

    def names(self) -> list[str]:
        return sorted(self._lru.keys())

    def slot_of(self, name: str) -> int:
        return self._lru[name]

    def info(self, name: str) -> CompositionInfo:
        return self._info[self.slot_of(name)]

    def experts_at(self, slot: int) -> list[str]:
        return list(self._info[slot].experts)

    def held(self) -> list[str]:
        return [n for n in self._lru if self._lru.held(n)]

    def can_hold(self, ref: str) -> bool:
        """Whether `ref` is resident or could take a slot no running request holds (True with
        no gate slots at all, so `ensure` reports that error)."""
        if not self.capacity or ref in self._lru:
            return True
        return len(self._lru) < self.capacity or next(self._lru.victims(), None) is not None

    def ensure(self, ref: str, source: AdapterSource) -> tuple[int, list[str]]:
        """Make a composition's gates resident; returns (gate slot, expert adapter names)."""
        if not self.capacity:
            raise HotSetFullError("hot_set.max_compositions is 0: learned routes are disabled")
        slot = self._lru.get(ref)
        if slot is None:
            comp = self._read(ref, source)
            slot = self._victim()
            self._write(slot, comp)
        return slot, list(self._info[slot].experts)

    def bind_experts(self, slot: int, expert_slots: list[int]) -> None:
        """Point the table's expert columns at the experts' current adapter slots."""
        self.table.expert_slots[slot].zero_()
        self.table.expert_slots[slot, : len(expert_slots)] = torch.tensor(
            expert_slots, dtype=torch.long
        )

    def acquire(self, ref: str) -> None:
        self.slot_of(ref)
        self._lru.hold(ref)

    def release(self, ref: str) -> None:
        if ref in self._lru:
            self._lru.unhold(ref)

    def _read(self, ref: str, source: AdapterSource) -> Composition:
        try:
            comp = load_composition(ref, source.composition_path(ref))
        except CompositionError as exc:
            raise AdapterLoadError(str(exc)) from exc
        cfg, arch = comp.config, self.arch
        if cfg.num_layers != arch.num_layers or cfg.hidden_size != arch.hidden_size:
            raise AdapterLoadError(
                f"composition {ref!r} was trained for {cfg.num_layers} layers × "
                f"{cfg.hidden_size} hidden, the base model has {arch.num_layers} × "
                f"{arch.hidden_size} (base-model mismatch)"
            )
        if len(cfg.adapters) > self.max_experts:
            raise AdapterLoadError(
                f"composition {ref!r} has {len(cfg.adapters)} experts, above "
                f"hot_set.max_composition_experts={self.max_experts}"
            )
        if len(cfg.adapters) > self.max_adapter_slots:
            raise AdapterLoadError(
                f"composition {ref!r} needs {len(cfg.adapters)} adapters at once but the hot-set "
                f"has {self.max_adapter_slots} slots"
            )
        return comp

    def _victim(self) -> int:
        used = set(self._info)
        free = [i for i in range(self.capacity) if i not in used]
        if free:
            return free[0]
        name = next(self._lru.victims(), None)
        if name is None:
            raise HotSetFullError("all composition slots are in use; the request must wait")
        slot = self._lru.pop(name)
        del self._info[slot]
        return slot

    def _write(self, slot: int, comp: Composition) -> None:
        K = len(comp.config.adapters)
        with torch.no_grad():
            self.table.weight[slot].zero_()
            self.table.bias[slot].zero_()
            self.table.weight[slot, :, :K].copy_(comp.gate_weight)
            if comp.gate_bias is not None:
                self.table.bias[slot, :, :K].copy_(comp.gate_bias)
            self.table.num_experts[slot] = K
        self._info[slot] = CompositionInfo(
            comp.name, list(comp.config.adapters), comp.config.top_k, comp.config.temperature
        )
        self._lru.put(comp.name, slot)
