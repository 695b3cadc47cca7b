"""The rulebook: what a servable PEFT LoRA adapter and a learned composition are.

One module, imported by the store (push, verify) and by the runtime's loader, so whatever the
runtime would refuse, push refuses first, with the same words. It works on plain data — the
adapter_config.json dict and (tensor name, dtype, shape) entries — so the store can check a
safetensors header without torch and the runtime can check loaded tensors.

Rules (every refusal is a `RuleError` naming the tensor or key at fault):
- files: `adapter_config.json` + `adapter_model.safetensors`; pickle files are refused;
- config: peft_type LORA; no DoRA, no trained biases (`bias`, `lora_bias`), no
  `modules_to_save`, no `fan_in_fan_out` (Conv1D), no `layer_replication`; 1 <= r <= MAX_RANK;
  |lora_alpha| <= MAX_ABS_ALPHA (alpha_pattern too); the JSON at most MAX_CONFIG_DEPTH deep and
  MAX_CONFIG_BYTES long; regexes (string `target_modules`, pattern keys) at most
  MAX_PATTERN_CHARS long, MAX_PATTERNS of them, valid RE2 and run only with RE2 against the
  canonical module path `model.layers.<i>.<block>.<module>` (linear time, never `re`);
- tensors: only `…layers.<i>.(self_attn|mlp).<module>.lora_(A|B)[.<name>].weight` for the seven
  projections of a decoder layer, float dtype, 2-D, every A with its B, rank equal to the config's
  (rank_pattern too), each module listed in `target_modules`, every listed module present;
- shapes: one (in, out) per module across layers and consistent between modules (q/k/v/gate/up
  read the hidden size, o/down write it, gate/up/down share the intermediate size), and, when the
  base model's config is known, equal to the base's shapes with every layer index in range;
- values: finite, |A| <= MAX_ABS_WEIGHT and |scale * B| <= MAX_ABS_WEIGHT elementwise, so a slot
  holds finite values in float16/bfloat16 after scale and cast (`check_values`);
- base identity: `base_identity(config.json)`, recorded on push, must match the served model's.
The config rules live in `peft_config`, the base-model rules in `base_model`, compositions
(`CompositionSpec`, `gate_shapes`) in `composition_spec`; this module checks the tensors.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from adapter_store.base_model import BaseShapes
from adapter_store.errors import RuleError
from adapter_store.limits import MAX_ABS_WEIGHT, MAX_KEY_CHARS
from adapter_store.peft_config import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    SERVABLE_MODULES,
    PeftConfig,
    lora_scale,
    module_path,
    pattern_value,
    targets_module,
)

FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
TENSOR_KEY = re.compile(
    r"^(?:.*\.)?layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<module>\w+)\."
    r"lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$"
)


@dataclass(frozen=True)
class TensorEntry:
    """What the rules need of one stored tensor."""

    key: str
    dtype: str  # safetensors name: F32, BF16, …
    shape: tuple[int, ...]


@dataclass
class AdapterPlan:
    """A checked adapter: per (module, layer) the A/B keys, rank and scale."""

    rank: int
    target_modules: list[str]
    num_layers: int
    dtypes: list[str]
    pairs: dict[tuple[str, int], tuple[str, str, int, float]] = field(default_factory=dict)


def check_adapter(
    cfg: PeftConfig, tensors: Iterable[TensorEntry], base: BaseShapes | None = None
) -> AdapterPlan:
    """Check every tensor against the rules (and `base`, when known); returns the plan."""
    found: dict[tuple[str, int], dict[str, TensorEntry]] = {}
    dtypes: set[str] = set()
    for t in tensors:
        if len(t.key) > MAX_KEY_CHARS:
            raise RuleError(f"tensor name {t.key[:64]!r}… is over {MAX_KEY_CHARS} characters")
        m = TENSOR_KEY.match(t.key)
        if m is None or m["module"] not in SERVABLE_MODULES:
            raise RuleError(
                f"tensor {t.key!r} is not a LoRA A/B weight of a module MoLoRA serves "
                f"({list(SERVABLE_MODULES)} inside decoder layers); MoLoRA does not serve it"
            )
        if t.dtype not in FLOAT_DTYPES:
            raise RuleError(f"tensor {t.key!r} has non-float dtype {t.dtype}")
        if len(t.shape) != 2:
            raise RuleError(f"tensor {t.key!r} is not 2-D: {tuple(t.shape)}")
        layer, module = int(m["layer"]), m["module"]
        if not targets_module(cfg, layer, module):
            raise RuleError(
                f"tensor {t.key!r}: {module!r} is not in target_modules {cfg.target_modules}"
            )
        if base is not None and layer >= base.num_layers:
            raise RuleError(
                f"tensor {t.key!r} is for layer {layer} but the base model has only "
                f"{base.num_layers} layers (base-model mismatch)"
            )
        dtypes.add(t.dtype)
        found.setdefault((module, layer), {})[m["ab"]] = t
    if not found:
        raise RuleError(f"{ADAPTER_WEIGHTS} holds no LoRA tensors")
    plan = AdapterPlan(rank=0, target_modules=[], num_layers=0, dtypes=sorted(dtypes))
    seen_dims: dict[str, tuple[tuple[int, int], str]] = {}
    for (module, layer), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise RuleError(f"{module} of layer {layer} lacks {missing}")
        a, b = ab["A"], ab["B"]
        (r_a, d_in), (d_out, r_b) = a.shape, b.shape
        pair = f"{a.key} {tuple(a.shape)} / {b.key} {tuple(b.shape)}"
        rank = int(pattern_value(cfg.rank_pattern, module_path(layer, module), cfg.r))
        if not r_a == r_b == rank:
            raise RuleError(f"{pair} disagree with rank r={rank} from {ADAPTER_CONFIG}")
        if base is not None:
            want = base.dims[module]
            if (d_in, d_out) != want:
                raise RuleError(
                    f"{pair}: LoRA maps {d_in}→{d_out} but the base model's {module} is "
                    f"{want[0]}→{want[1]} (base-model mismatch)"
                )
        prev = seen_dims.setdefault(module, ((d_in, d_out), pair))
        if prev[0] != (d_in, d_out):
            raise RuleError(
                f"{pair}: LoRA maps {d_in}→{d_out} but {prev[1]} maps {module} "
                f"{prev[0][0]}→{prev[0][1]} (inconsistent shapes)"
            )
        plan.pairs[(module, layer)] = (a.key, b.key, rank, lora_scale(cfg, layer, module, rank))
        plan.rank = max(plan.rank, rank)
        plan.num_layers = max(plan.num_layers, layer + 1)
    _check_cross_module(seen_dims)
    plan.target_modules = sorted(seen_dims)
    if isinstance(cfg.target_modules, list):
        unused = sorted(set(cfg.target_modules) - set(seen_dims))
        if unused:
            raise RuleError(f"target_modules {unused} have no LoRA tensors in {ADAPTER_WEIGHTS}")
    return plan


# (module, side) pairs that must agree: side 0 = in, 1 = out
_SAME_SIZE = (
    ("hidden size", [("q_proj", 0), ("k_proj", 0), ("v_proj", 0), ("gate_proj", 0),
                     ("up_proj", 0), ("o_proj", 1), ("down_proj", 1)]),
    ("intermediate size", [("gate_proj", 1), ("up_proj", 1), ("down_proj", 0)]),
    ("key/value width", [("k_proj", 1), ("v_proj", 1)]),
    ("query width", [("q_proj", 1), ("o_proj", 0)]),
)  # fmt: skip


def _check_cross_module(dims: dict[str, tuple[tuple[int, int], str]]) -> None:
    """Modules of one decoder must agree on the sizes they share (no base config needed)."""
    for what, sides in _SAME_SIZE:
        sizes = {(m, s): dims[m][0][s] for m, s in sides if m in dims}
        if len(set(sizes.values())) > 1:
            listed = ", ".join(
                f"{m} {'in' if s == 0 else 'out'}={v}" for (m, s), v in sizes.items()
            )
            raise RuleError(f"LoRA shapes disagree on the {what}: {listed}")


def nonfinite_message(key: str) -> str:
    return f"tensor {key!r} holds NaN or Inf values"


def check_values(key: str, max_abs: float, scale: float = 1.0) -> None:
    """Refuse a tensor whose largest |value| (times its LoRA scale, for B) is non-finite or
    over MAX_ABS_WEIGHT: what a slot would hold after scale and cast must stay finite."""
    if not math.isfinite(max_abs):
        raise RuleError(nonfinite_message(key))
    if max_abs * abs(scale) > MAX_ABS_WEIGHT:
        raise RuleError(
            f"tensor {key!r} holds |values| up to {max_abs:.3g}"
            + (f" (x scale {scale:.3g})" if scale != 1.0 else "")
            + f", over the bound {MAX_ABS_WEIGHT:g} on slot contents"
        )
