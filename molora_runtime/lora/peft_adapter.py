"""Read a PEFT LoRA folder into per-module, per-layer (A, scaled B) tensors, checking everything.

What a servable adapter is lives in one rulebook, `adapter_store.rules` (the store's push and
verify apply the same rules first); this loader adds what only a server knows — the hot-set's
`max_rank` and `target_modules` — and checks values on the loaded tensors. Every refusal names
the adapter and, where one is at fault, the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from adapter_store import base_model, peft_config, rules
from adapter_store.errors import RuleError
from molora_runtime.errors import AdapterLoadError
from molora_runtime.model.arch import ModelArch

CONFIG_FILE = peft_config.ADAPTER_CONFIG
WEIGHTS_FILE = peft_config.ADAPTER_WEIGHTS
PICKLE_SUFFIXES = tuple(sorted(peft_config.PICKLE_SUFFIXES))
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
}


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


def base_shapes(arch: ModelArch) -> base_model.BaseShapes:
    return base_model.BaseShapes(
        arch.num_layers, {m: arch.linear_shape(m) for m in peft_config.SERVABLE_MODULES}
    )


def arch_identity(arch: ModelArch) -> str:
    """The rulebook's base identity of a loaded model (same fields as its config.json)."""
    return base_model.base_identity(
        {
            "model_type": arch.model_type,
            "hidden_size": arch.hidden_size,
            "intermediate_size": arch.intermediate_size,
            "num_hidden_layers": arch.num_layers,
            "num_attention_heads": arch.num_heads,
            "num_key_value_heads": arch.num_kv_heads,
            "head_dim": arch.head_dim,
            "vocab_size": arch.vocab_size,
        }
    )


def read_peft_config(name: str, folder: Path) -> peft_config.PeftConfig:
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
        return peft_config.read_peft_config_text(cfg_path.read_text())
    except (RuleError, UnicodeDecodeError) as exc:
        raise AdapterLoadError(f"adapter {name!r}: {exc}") from exc


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
    entries = [
        rules.TensorEntry(key, _ST_DTYPES.get(t.dtype, str(t.dtype)), tuple(t.shape))
        for key, t in tensors.items()
    ]
    try:
        plan = rules.check_adapter(config, entries, base_shapes(arch))
    except RuleError as exc:
        raise AdapterLoadError(f"adapter {name!r}: {exc}") from exc
    nonfinite = _first_nonfinite(tensors)
    if nonfinite is not None:
        raise AdapterLoadError(f"adapter {name!r}: {rules.nonfinite_message(nonfinite)}")
    adapter = AdapterWeights(name=name, rank=plan.rank, base_model=config.base_model_name_or_path)
    for (module, layer), (key_a, key_b, r, scale) in plan.pairs.items():
        if module not in allowed_targets:
            raise AdapterLoadError(
                f"adapter {name!r}: tensor {key_a!r} targets {module!r}, which this hot-set does "
                f"not serve (hot_set.target_modules={allowed_targets})"
            )
        if r > max_rank:
            raise AdapterLoadError(
                f"adapter {name!r}: tensor {key_a} has rank {r}, above hot_set.max_rank={max_rank}"
            )
        a, b = tensors[key_a], tensors[key_b]
        adapter.modules.setdefault(module, {})[layer] = (a.float(), b.float() * scale)
    return adapter


def _first_nonfinite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The first tensor (by key) holding a NaN or an infinity, if any: one check over all of
    them per dtype, since a per-tensor check costs ~120 dispatches for a 30-layer adapter."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors.values():
        by_dtype.setdefault(t.dtype, []).append(t.reshape(-1))
    if all(bool(torch.isfinite(torch.cat(flat)).all()) for flat in by_dtype.values()):
        return None
    return next(key for key in sorted(tensors) if not bool(torch.isfinite(tensors[key]).all()))
