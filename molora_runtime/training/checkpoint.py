"""Resumable training checkpoints as safetensors + json (never pickle).

A checkpoint holds the trainable tensors, the optimizer state flattened into named tensors, and
a json with the step and the training config, so a resumed run refuses a different config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

STATE_FILE = "trainer_state.json"
TENSORS_FILE = "trainer_state.safetensors"


def save_checkpoint(
    folder: Path,
    step: int,
    params: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    config: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> None:
    """Write atomically (temp files, then rename) so an interrupted save never corrupts a resume."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"param.{k}": v.detach().contiguous().cpu() for k, v in params.items()}
    opt = optimizer.state_dict()
    for index, state in opt["state"].items():
        for key, value in state.items():
            tensors[f"opt.{index}.{key}"] = torch.as_tensor(value).detach().contiguous().cpu()
    meta = {"step": step, "config": config, "param_groups": opt["param_groups"], **(extra or {})}
    tmp_t, tmp_j = folder / (TENSORS_FILE + ".tmp"), folder / (STATE_FILE + ".tmp")
    save_file(tensors, str(tmp_t))
    tmp_j.write_text(json.dumps(meta, indent=2))
    tmp_t.replace(folder / TENSORS_FILE)
    tmp_j.replace(folder / STATE_FILE)


def load_checkpoint(
    folder: Path,
    params: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    config: dict[str, Any],
) -> dict[str, Any] | None:
    """Restore params and optimizer in place; return the saved metadata, or None if absent."""
    if not (folder / STATE_FILE).is_file():
        return None
    meta = json.loads((folder / STATE_FILE).read_text())
    if meta["config"] != config:
        raise ValueError(
            f"checkpoint in {folder} was written by a different training config; "
            "use a new output folder or the same arguments"
        )
    tensors = load_file(str(folder / TENSORS_FILE))
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[f"param.{name}"])
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("opt."):
            _, index, sub = key.split(".", 2)
            state.setdefault(int(index), {})[sub] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    return meta
