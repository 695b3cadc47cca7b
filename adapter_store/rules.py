"""The rulebook: what a servable PEFT LoRA adapter and a learned composition are.

One module, imported by the store (push, verify) and by the runtime's loader, so whatever the
runtime would refuse, push refuses first, with the same words. It works on plain data — the
adapter_config.json dict and (tensor name, dtype, shape) entries — so the store can check a
safetensors header without torch and the runtime can check loaded tensors.

Rules (every refusal is a `RuleError` naming the tensor or key at fault):
- files: `adapter_config.json` + `adapter_model.safetensors`; pickle files are refused;
- config: peft_type LORA; no DoRA, no trained biases (`bias`, `lora_bias`), no
  `modules_to_save`, no `fan_in_fan_out` (Conv1D), no `layer_replication`; r >= 1; finite alpha;
- tensors: only `…layers.<i>.(self_attn|mlp).<module>.lora_(A|B)[.<name>].weight` for the seven
  projections of a decoder layer, float dtype, 2-D, every A with its B, rank equal to the config's
  (rank_pattern too), each module listed in `target_modules`, every listed module present;
- shapes: one (in, out) per module across layers and consistent between modules (q/k/v/gate/up
  read the hidden size, o/down write it, gate/up/down share the intermediate size), and, when the
  base model's config is known, equal to the base's shapes with every layer index in range;
- values: finite (no NaN/Inf), checked by each side on the arrays it reads;
- base identity: `base_identity(config.json)`, recorded on push, must match the served model's.
Compositions: `CompositionSpec` (composition.json) and `gate_shapes`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from adapter_store.names import parse_ref

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"})
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SERVABLE_MODULES: tuple[str, ...] = ATTENTION_MODULES + MLP_MODULES
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
TENSOR_KEY = re.compile(
    r"^(?:.*\.)?layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<module>\w+)\."
    r"lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$"
)
# Slot contents (A and scale * B): far inside float16's 65504, so scale and cast stay finite.
MAX_ABS_WEIGHT = 1.0e4
MIN_GATE_TEMPERATURE = 0.01
MAX_GATE_TEMPERATURE = 100.0
COMPOSITION_CONFIG = "composition.json"
GATES_FILE = "gates.safetensors"
COMPOSITION_FORMAT = "molora-composition"
# The architecture fields that decide every weight shape: the base model's identity.
IDENTITY_FIELDS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size",
)  # fmt: skip


class RuleError(ValueError):
    """An adapter or composition breaks a rule; the message names the tensor or key."""


# ----- adapter_config.json ---------------------------------------------------------------------


class PeftConfig(BaseModel):
    """The keys of PEFT's adapter_config.json that decide how an adapter is served."""

    model_config = ConfigDict(extra="allow")

    peft_type: str = "LORA"
    r: int = Field(ge=1)
    lora_alpha: float = Field(allow_inf_nan=False)
    target_modules: list[str] | str
    base_model_name_or_path: str | None = None
    rank_pattern: dict[str, int] = Field(default_factory=dict)
    alpha_pattern: dict[str, float] = Field(default_factory=dict)
    use_rslora: bool = False
    use_dora: bool = False
    fan_in_fan_out: bool = False
    bias: str = "none"
    lora_bias: bool = False
    modules_to_save: list[str] | None = None
    layer_replication: Any = None

    @model_validator(mode="after")
    def _servable(self) -> PeftConfig:
        if self.peft_type.upper() != "LORA":
            raise ValueError(f"peft_type must be LORA, got {self.peft_type!r}")
        refusals = [
            (self.use_dora, "DoRA adapters (use_dora=true) are not supported"),
            (self.fan_in_fan_out, "fan_in_fan_out (Conv1D) adapters are not supported"),
            (self.bias != "none", f"trained biases (bias={self.bias!r}) are not supported"),
            (self.lora_bias, "trained LoRA biases (lora_bias=true) are not supported"),
            (
                bool(self.modules_to_save),
                f"modules_to_save={self.modules_to_save} adds fully trained modules, which "
                "cannot be served per token",
            ),
            (self.layer_replication is not None, "layer_replication is not supported"),
        ]
        for refused, why in refusals:
            if refused:
                raise ValueError(why)
        return self


def parse_peft_config(data: Any) -> PeftConfig:
    """Validate an adapter_config.json dict; raises RuleError with the first problem."""
    if not isinstance(data, dict):
        raise RuleError(f"{ADAPTER_CONFIG} is not a JSON object")
    try:
        return PeftConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        raise RuleError(
            f"{ADAPTER_CONFIG} is not a valid PEFT LoRA config: "
            + (f"{where}: {msg}" if where else msg)
        ) from None


def read_peft_config_text(text: str) -> PeftConfig:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RuleError(
            f"{ADAPTER_CONFIG} is not a valid PEFT LoRA config: bad JSON: {exc}"
        ) from None
    return parse_peft_config(data)


def _pattern_value(patterns: Mapping[str, float], key: str, default: float) -> float:
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):  # as peft.utils.other.get_pattern_key
            return value
    return default


def module_path(layer: int, module: str) -> str:
    """The module's name inside a HF decoder (what rank/alpha patterns are matched against)."""
    block = "self_attn" if module in ATTENTION_MODULES else "mlp"
    return f"model.layers.{layer}.{block}.{module}"


def lora_scale(cfg: PeftConfig, layer: int, module: str, rank: int) -> float:
    """alpha / r (or alpha / sqrt(r) with rsLoRA), with alpha_pattern applied."""
    alpha = _pattern_value(cfg.alpha_pattern, module_path(layer, module), cfg.lora_alpha)
    return alpha / (math.sqrt(rank) if cfg.use_rslora else rank)


# ----- tensors ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorEntry:
    """What the rules need of one stored tensor."""

    key: str
    dtype: str  # safetensors name: F32, BF16, …
    shape: tuple[int, ...]


@dataclass(frozen=True)
class BaseShapes:
    """Decoder layers and (in, out) of each servable projection of a base model."""

    num_layers: int
    dims: dict[str, tuple[int, int]]


@dataclass
class AdapterPlan:
    """A checked adapter: per (module, layer) the A/B keys, rank and scale."""

    rank: int
    target_modules: list[str]
    num_layers: int
    dtypes: list[str]
    pairs: dict[tuple[str, int], tuple[str, str, int, float]] = field(default_factory=dict)


def base_shapes(cfg: Mapping[str, Any]) -> BaseShapes:
    """Shapes of a Llama/Qwen/Mistral-style decoder from its HF config.json."""
    try:
        hidden, heads, layers = (
            int(cfg["hidden_size"]),
            int(cfg["num_attention_heads"]),
            int(cfg["num_hidden_layers"]),
        )
        inter = int(cfg["intermediate_size"])
    except KeyError as exc:
        raise RuleError(f"base model config lacks {exc.args[0]!r}") from None
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    q, kvd = heads * head_dim, kv * head_dim
    dims = {
        "q_proj": (hidden, q), "k_proj": (hidden, kvd), "v_proj": (hidden, kvd), "o_proj": (q, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }  # fmt: skip
    return BaseShapes(layers, dims)


def base_identity(cfg: Mapping[str, Any]) -> str:
    """sha256 of the architecture fields that decide every weight shape (IDENTITY_FIELDS)."""
    heads = cfg.get("num_attention_heads")
    canon = {k: cfg.get(k) for k in IDENTITY_FIELDS}
    canon["num_key_value_heads"] = canon["num_key_value_heads"] or heads
    if not canon["head_dim"] and heads and cfg.get("hidden_size"):
        canon["head_dim"] = int(cfg["hidden_size"]) // int(heads)
    return hashlib.sha256(json.dumps(canon, sort_keys=True).encode()).hexdigest()


def _targeted(cfg: PeftConfig, key: str, layer: int, module: str) -> bool:
    targets = cfg.target_modules
    if isinstance(targets, str):
        prefix = key.split(".lora_", 1)[0]
        return bool(
            re.fullmatch(targets, prefix) or re.fullmatch(targets, module_path(layer, module))
        )
    return module in targets


def check_adapter(
    cfg: PeftConfig, tensors: Iterable[TensorEntry], base: BaseShapes | None = None
) -> AdapterPlan:
    """Check every tensor against the rules (and `base`, when known); returns the plan."""
    found: dict[tuple[str, int], dict[str, TensorEntry]] = {}
    dtypes: set[str] = set()
    for t in tensors:
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
        if not _targeted(cfg, t.key, layer, module):
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
        rank = int(_pattern_value(cfg.rank_pattern, module_path(layer, module), cfg.r))
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


# ----- base model ------------------------------------------------------------------------------


def _norm_name(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1].lower()


def check_declared_base(
    declared_name: str | None,
    declared_identity: str | None,
    served_names: Iterable[str],
    served_identity: str | None,
) -> None:
    """Refuse an adapter published for another base model than the served one.

    The identity (recorded when the adapter was pushed with the base's config.json) decides
    when both sides have one. Otherwise a declared hub id (`org/name`) or alias must match
    one of the served model's names (case-insensitive, by last path component); a declared
    local path cannot be checked and passes (its shapes are still checked).
    """
    served = [n for n in served_names if n]
    if declared_identity and served_identity:
        if declared_identity != served_identity:
            raise RuleError(
                f"was published for base model {declared_name!r} (identity "
                f"{declared_identity[:12]}…) but this server runs {served[0] if served else '?'!r} "
                f"(identity {served_identity[:12]}…): base-model mismatch"
            )
        return
    if (
        not declared_name
        or declared_name.startswith(("/", ".", "~"))
        or declared_name.count("/") > 1
    ):
        return
    if _norm_name(declared_name) not in {_norm_name(n) for n in served}:
        raise RuleError(
            f"declares base model {declared_name!r} but this server runs "
            f"{served[0] if served else '?'!r}: base-model mismatch"
        )


# ----- compositions ----------------------------------------------------------------------------


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
