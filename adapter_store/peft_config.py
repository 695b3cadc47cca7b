"""PEFT's adapter_config.json as MoLoRA serves it: the keys it accepts, scales and targets.

Refusals raise `RuleError` with the words push and the runtime loader both show.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from adapter_store.errors import RuleError
from adapter_store.limits import (
    MAX_ABS_ALPHA,
    MAX_CONFIG_BYTES,
    MAX_CONFIG_DEPTH,
    MAX_RANK,
    check_patterns,
    json_depth,
)
from adapter_store.patterns import fullmatch as pattern_fullmatch
from adapter_store.patterns import suffix_match as pattern_suffix_match

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"})
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SERVABLE_MODULES: tuple[str, ...] = ATTENTION_MODULES + MLP_MODULES


class PeftConfig(BaseModel):
    """The keys of PEFT's adapter_config.json that decide how an adapter is served."""

    model_config = ConfigDict(extra="allow")

    peft_type: str = "LORA"
    r: int = Field(ge=1, le=MAX_RANK)
    lora_alpha: float = Field(allow_inf_nan=False, ge=-MAX_ABS_ALPHA, le=MAX_ABS_ALPHA)
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
        check_patterns(self.target_modules, self.rank_pattern, self.alpha_pattern)
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
    if len(text) > MAX_CONFIG_BYTES:
        raise RuleError(f"{ADAPTER_CONFIG} is over {MAX_CONFIG_BYTES} bytes")
    if json_depth(text) > MAX_CONFIG_DEPTH:
        raise RuleError(f"{ADAPTER_CONFIG} nests deeper than {MAX_CONFIG_DEPTH} levels")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RuleError(
            f"{ADAPTER_CONFIG} is not a valid PEFT LoRA config: bad JSON: {exc}"
        ) from None
    return parse_peft_config(data)


def pattern_value(patterns: Mapping[str, float], key: str, default: float) -> float:
    for pattern, value in patterns.items():
        if pattern_suffix_match(pattern, key):  # as peft.utils.other.get_pattern_key, in RE2
            return value
    return default


def module_path(layer: int, module: str) -> str:
    """The module's name inside a HF decoder (what rank/alpha patterns are matched against)."""
    block = "self_attn" if module in ATTENTION_MODULES else "mlp"
    return f"model.layers.{layer}.{block}.{module}"


def lora_scale(cfg: PeftConfig, layer: int, module: str, rank: int) -> float:
    """alpha / r (or alpha / sqrt(r) with rsLoRA), with alpha_pattern applied."""
    alpha = pattern_value(cfg.alpha_pattern, module_path(layer, module), cfg.lora_alpha)
    return alpha / (math.sqrt(rank) if cfg.use_rslora else rank)


def targets_module(cfg: PeftConfig, layer: int, module: str) -> bool:
    """A string `target_modules` is matched only against the canonical module path."""
    targets = cfg.target_modules
    if isinstance(targets, str):
        return pattern_fullmatch(targets, module_path(layer, module))
    return module in targets
