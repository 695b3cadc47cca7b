"""Load an HF folder (config.json + safetensors, sharded or not) into `CausalLM`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from molora_runtime.model.arch import ModelArch, load_arch
from molora_runtime.model.decoder import CausalLM


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match its config."""


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise CheckpointError(
            f"{folder} holds only pickle weights (.bin/.pt); convert them to safetensors"
        )
    raise CheckpointError(f"no model.safetensors in {folder}")


def _hf_key(name: str) -> str:
    return name if name == "lm_head.weight" else "model." + name


def load_model(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
) -> CausalLM:
    """Build the decoder for `folder` and fill it from its safetensors (strict key check)."""
    folder = Path(folder)
    arch: ModelArch = load_arch(folder)
    with torch.device("meta"):
        model = CausalLM(arch, max_positions=max_positions)
    params = dict(model.named_parameters())
    expected = {_hf_key(n): n for n in params}
    loaded: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if key in expected:
                    loaded[expected[key]] = f.get_tensor(key)
                elif not key.endswith("rotary_emb.inv_freq"):
                    raise CheckpointError(f"unexpected tensor {key!r} in {path.name}")
    missing = sorted(set(params) - set(loaded))
    if missing:
        raise CheckpointError(f"checkpoint {folder} lacks tensors: {missing[:5]}")
    for name, tensor in loaded.items():
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise CheckpointError(
                f"tensor {name} has shape {tuple(tensor.shape)}, config implies "
                f"{tuple(params[name].shape)}"
            )
    state = {n: t.to(dtype) for n, t in loaded.items()}
    # Parameters take the serving dtype before loading: load_state_dict copies into them, so
    # leaving them at the default float32 would silently serve every dtype in fp32.
    model = model.to_empty(device=device).to(dtype)
    model.load_state_dict(state, strict=False, assign=False)
    # Non-persistent buffers (rope tables) were on meta: rebuild them on the device.
    model.rope = type(model.rope)(arch.head_dim, model.rope.cos.shape[0], arch.rope).to(device)
    model.requires_grad_(False)
    model.fuse_projections()
    return model.eval()
