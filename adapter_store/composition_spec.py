"""A learned composition's composition.json: K expert adapters, top-k, temperature, gate shapes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from adapter_store.names import parse_ref

MIN_GATE_TEMPERATURE = 0.01
MAX_GATE_TEMPERATURE = 100.0
COMPOSITION_CONFIG = "composition.json"
GATES_FILE = "gates.safetensors"
COMPOSITION_FORMAT = "molora-composition"


class CompositionSpec(BaseModel):
    """composition.json: K adapter references in gate order, top-k, temperature, shapes."""

    model_config = ConfigDict(extra="forbid")

    format: str = COMPOSITION_FORMAT
    format_version: int = 1
    base_model: str = Field(min_length=1, description="base model id the gates were trained on")
    adapters: list[str] = Field(min_length=1, description="the K expert adapters, in gate order")
    top_k: int = Field(2, ge=1)
    temperature: float = Field(1.0, ge=MIN_GATE_TEMPERATURE, le=MAX_GATE_TEMPERATURE)
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)

    @model_validator(mode="after")
    def _check(self) -> CompositionSpec:
        if self.format != COMPOSITION_FORMAT:
            raise ValueError(f"format must be {COMPOSITION_FORMAT!r}, got {self.format!r}")
        if self.format_version != 1:
            raise ValueError(f"unsupported format_version {self.format_version}")
        names = [parse_ref(ref).name for ref in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError("a composition lists an adapter twice")
        if self.top_k > len(self.adapters):
            raise ValueError(f"top_k={self.top_k} exceeds the {len(self.adapters)} adapters")
        return self


def gate_shapes(spec: CompositionSpec) -> dict[str, tuple[int, ...]]:
    """Required `gate.weight` [L, K, d] and optional `gate.bias` [L, K]."""
    k = len(spec.adapters)
    return {
        "gate.weight": (spec.num_layers, k, spec.hidden_size),
        "gate.bias": (spec.num_layers, k),
    }
