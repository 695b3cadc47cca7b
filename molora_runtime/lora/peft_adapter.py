"""Read a PEFT LoRA folder into per-module, per-layer (A, scaled B) tensors, checking everything.

Every refusal names the adapter and, where one is at fault, the tensor: pickle files, DoRA and
other unsupported options, ranks above the hot-set's `max_rank`, target modules the hot-set does
not serve, shapes that disagree with the base model, NaN/Inf values, missing files.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from molora_runtime.config import LORA_TARGET_MODULES
from molora_runtime.errors import AdapterLoadError
from molora_runtime.model.arch import ModelArch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
_KEY = re.compile(
    r"^(?:.*\.)?layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<module>\w+)\."
    r"lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$"
)


@dataclass
class AdapterWeights:
    """An adapter ready to copy into a hot-set slot (scale already folded into B)."""

    name: str
    rank: int
    modules: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    base_model: str | None = None

    def nbytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for layers in self.modules.values()
            for a, b in layers.values()
        )


def _pattern_value(patterns: dict[str, float], key: str, default: float) -> float:
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):  # as peft.utils.other.get_pattern_key
            return value
    return default


def read_peft_config(name: str, folder: Path) -> dict:
    if not folder.is_dir():
        raise AdapterLoadError(f"adapter {name!r}: folder {folder} does not exist")
    cfg_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not weights_path.is_file():
        pickles = [p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickles:
            raise AdapterLoadError(
                f"adapter {name!r}: only pickle weights found ({pickles}); pickle files are "
                "refused, save the adapter with safetensors (save_pretrained does by default)"
            )
        raise AdapterLoadError(f"adapter {name!r}: missing file {WEIGHTS_FILE} in {folder}")
    if not cfg_path.is_file():
        raise AdapterLoadError(f"adapter {name!r}: missing file {CONFIG_FILE} in {folder}")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise AdapterLoadError(f"adapter {name!r}: {CONFIG_FILE} is not valid JSON: {exc}") from exc
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterLoadError(
            f"adapter {name!r}: peft_type {config.get('peft_type')!r} is not LORA"
        )
    for flag, why in (
        ("use_dora", "DoRA adapters are not supported"),
        ("fan_in_fan_out", "fan_in_fan_out (Conv1D) adapters are not supported"),
    ):
        if config.get(flag):
            raise AdapterLoadError(f"adapter {name!r}: {why}")
    if config.get("bias", "none") != "none":
        raise AdapterLoadError(
            f"adapter {name!r}: trained biases (bias={config['bias']!r}) are not supported"
        )
    if config.get("modules_to_save"):
        raise AdapterLoadError(
            f"adapter {name!r}: modules_to_save={config['modules_to_save']} (fully trained "
            "modules) cannot be served per token"
        )
    return config


def read_peft_adapter(
    name: str,
    folder: str | Path,
    arch: ModelArch,
    allowed_targets: list[str],
    max_rank: int,
) -> AdapterWeights:
    """Parse and validate a PEFT folder for `arch`; raises AdapterLoadError on any problem."""
    folder = Path(folder)
    config = read_peft_config(name, folder)
    try:
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except (SafetensorError, OSError) as exc:
        raise AdapterLoadError(f"adapter {name!r}: cannot read {WEIGHTS_FILE}: {exc}") from exc
    alpha = float(config.get("lora_alpha", config.get("r", 8)))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    use_rslora = bool(config.get("use_rslora", False))

    pairs: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterLoadError(
                f"adapter {name!r}: tensor {key!r} targets a module MoLoRA does not serve "
                f"(supported: {list(LORA_TARGET_MODULES)} inside decoder layers)"
            )
        module, layer = match["module"], int(match["layer"])
        if module not in LORA_TARGET_MODULES:
            raise AdapterLoadError(
                f"adapter {name!r}: tensor {key!r} targets unknown module {module!r}"
            )
        if module not in allowed_targets:
            raise AdapterLoadError(
                f"adapter {name!r}: tensor {key!r} targets {module!r}, which this hot-set does "
                f"not serve (hot_set.target_modules={allowed_targets})"
            )
        if layer >= arch.num_layers:
            raise AdapterLoadError(
                f"adapter {name!r}: tensor {key!r} is for layer {layer} but the base model has "
                f"{arch.num_layers} layers (base-model mismatch)"
            )
        if not torch.isfinite(tensor).all():
            raise AdapterLoadError(f"adapter {name!r}: tensor {key!r} holds NaN or Inf values")
        pairs.setdefault((module, layer), {})[match["ab"]] = (key, tensor)  # type: ignore[assignment]

    adapter = AdapterWeights(name=name, rank=0, base_model=config.get("base_model_name_or_path"))
    for (module, layer), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterLoadError(
                f"adapter {name!r}: {module} of layer {layer} lacks lora_{'B' if 'A' in ab else 'A'}"
            )
        (key_a, a), (key_b, b) = ab["A"], ab["B"]  # type: ignore[misc]
        d_in, d_out = arch.linear_shape(module)
        r = a.shape[0]
        if (
            a.dim() != 2
            or b.dim() != 2
            or a.shape[1] != d_in
            or b.shape[0] != d_out
            or b.shape[1] != r
        ):
            raise AdapterLoadError(
                f"adapter {name!r}: {key_a} {tuple(a.shape)} / {key_b} {tuple(b.shape)} do not fit "
                f"{module} of the base model (in={d_in}, out={d_out}); base-model mismatch?"
            )
        if r > max_rank:
            raise AdapterLoadError(
                f"adapter {name!r}: tensor {key_a} has rank {r}, above hot_set.max_rank={max_rank}"
            )
        module_key = f"model.layers.{layer}.{'self_attn' if module.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}.{module}"
        r_cfg = _pattern_value(rank_pattern, module_key, float(config.get("r", r)))
        if int(r_cfg) != r:
            raise AdapterLoadError(
                f"adapter {name!r}: tensor {key_a} has rank {r} but adapter_config.json says {int(r_cfg)}"
            )
        a_alpha = _pattern_value(alpha_pattern, module_key, alpha)
        scale = a_alpha / (math.sqrt(r) if use_rslora else r)
        adapter.modules.setdefault(module, {})[layer] = (a.float(), b.float() * scale)
        adapter.rank = max(adapter.rank, r)
    if not adapter.modules:
        raise AdapterLoadError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA tensors")
    return adapter
