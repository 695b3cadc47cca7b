"""The learned-composition (MoLoRA) file format and its loader.

A composition folder holds:
- `composition.json`: `CompositionConfig` below (K adapter references, top-k, temperature, shapes);
- `gates.safetensors`: `gate.weight` float [L, K, d] and optional `gate.bias` [L, K] — one linear
  gate d→K per decoder layer, applied to that layer's normed attention input.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from safetensors.torch import load_file, save_file

from molora_runtime.routes import check_ref

COMPOSITION_CONFIG = "composition.json"
GATES_FILE = "gates.safetensors"
FORMAT_NAME = "molora-composition"


class CompositionError(ValueError):
    """A composition folder is missing files or disagrees with the model."""


class CompositionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: str = FORMAT_NAME
    format_version: int = 1
    base_model: str = Field(description="base model id the gates were trained on")
    adapters: list[str] = Field(min_length=1, description="the K expert adapters, in gate order")
    top_k: int = Field(2, ge=1)
    temperature: float = Field(1.0, gt=0)
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)

    @model_validator(mode="after")
    def _check(self) -> CompositionConfig:
        if self.format != FORMAT_NAME:
            raise ValueError(f"format must be {FORMAT_NAME!r}, got {self.format!r}")
        for ref in self.adapters:
            check_ref(ref)
        if len(set(self.adapters)) != len(self.adapters):
            raise ValueError("a composition lists an adapter twice")
        if self.top_k > len(self.adapters):
            raise ValueError(f"top_k={self.top_k} exceeds the {len(self.adapters)} adapters")
        return self


@dataclass
class Composition:
    """A loaded composition: config plus gate tensors."""

    name: str
    config: CompositionConfig
    gate_weight: torch.Tensor  # [L, K, d]
    gate_bias: torch.Tensor | None  # [L, K]


def read_composition_config(name: str, folder: str | Path) -> CompositionConfig:
    """Parse only `composition.json` (experts, top-k): what request validation needs."""
    cfg_path = Path(folder) / COMPOSITION_CONFIG
    if not cfg_path.is_file():
        raise CompositionError(f"composition {name!r}: missing file {cfg_path.name} in {folder}")
    try:
        return CompositionConfig.model_validate(json.loads(cfg_path.read_text()))
    except (ValidationError, json.JSONDecodeError) as exc:
        raise CompositionError(
            f"composition {name!r}: invalid {COMPOSITION_CONFIG}: {exc}"
        ) from exc


def load_composition(name: str, folder: str | Path) -> Composition:
    """Load and validate a composition folder; errors name the composition and the problem."""
    folder = Path(folder)
    config = read_composition_config(name, folder)
    gates_path = folder / GATES_FILE
    if not gates_path.is_file():
        raise CompositionError(f"composition {name!r}: missing file {GATES_FILE} in {folder}")
    tensors = load_file(str(gates_path))
    if "gate.weight" not in tensors:
        raise CompositionError(f"composition {name!r}: {GATES_FILE} lacks 'gate.weight'")
    weight = tensors["gate.weight"].float()
    bias = tensors.get("gate.bias")
    expected = (config.num_layers, len(config.adapters), config.hidden_size)
    if tuple(weight.shape) != expected:
        raise CompositionError(
            f"composition {name!r}: gate.weight has shape {tuple(weight.shape)}, expected {expected}"
        )
    if bias is not None:
        bias = bias.float()
        if tuple(bias.shape) != expected[:2]:
            raise CompositionError(
                f"composition {name!r}: gate.bias has shape {tuple(bias.shape)}, expected {expected[:2]}"
            )
    for tname, t in (("gate.weight", weight), ("gate.bias", bias)):
        if t is not None and not torch.isfinite(t).all():
            raise CompositionError(f"composition {name!r}: {tname} holds NaN or Inf values")
    return Composition(name=name, config=config, gate_weight=weight, gate_bias=bias)


def save_composition(
    folder: str | Path,
    config: CompositionConfig,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor | None = None,
) -> Path:
    """Write a composition folder (used by router training and tests)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {"gate.weight": gate_weight.detach().float().contiguous().cpu()}
    if gate_bias is not None:
        tensors["gate.bias"] = gate_bias.detach().float().contiguous().cpu()
    save_file(tensors, str(folder / GATES_FILE))
    (folder / COMPOSITION_CONFIG).write_text(config.model_dump_json(indent=2) + "\n")
    return folder
