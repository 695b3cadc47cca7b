"""The per-step routing metadata, as `lora/` names it (defined beside the model that reads it)."""

from __future__ import annotations

from molora_runtime.model.lora_context import GateTable, LoRAContext

__all__ = ["GateTable", "LoRAContext"]
