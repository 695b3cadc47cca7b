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
from pydantic import ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from adapter_store import composition_spec

COMPOSITION_CONFIG = composition_spec.COMPOSITION_CONFIG
GATES_FILE = composition_spec.GATES_FILE
FORMAT_NAME = composition_spec.COMPOSITION_FORMAT


class CompositionError(ValueError):
    """A composition folder is missing files or disagrees with the model."""


# The format's rules live in the rulebook the store validates with (one definition).
CompositionConfig = composition_spec.CompositionSpec


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
    try:
        tensors = load_file(str(gates_path))
    except (SafetensorError, OSError) as exc:
        raise CompositionError(f"composition {name!r}: cannot read {GATES_FILE}: {exc}") from exc
    shapes = composition_spec.gate_shapes(config)
    extra = sorted(set(tensors) - set(shapes))
    if extra or "gate.weight" not in tensors:
        raise CompositionError(
            f"composition {name!r}: {GATES_FILE} must hold 'gate.weight' (and optionally "
            f"'gate.bias'); found {sorted(tensors)}"
        )
    for tname, t in tensors.items():
        if tuple(t.shape) != shapes[tname]:
            raise CompositionError(
                f"composition {name!r}: {tname} has shape {tuple(t.shape)}, expected "
                f"{shapes[tname]} (num_layers, K adapters, hidden_size)"
            )
    weight = tensors["gate.weight"].float()
    bias = tensors.get("gate.bias")
    bias = bias.float() if bias is not None else None
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
